"""Your first image: the embedded digits model, in this process (no server)."""

from dit_core import Engine, SamplingParams
from dit_core.zoo import default_model

engine = Engine.from_pretrained(default_model())  # the embedded digits model, 9.5 MB, shipped with omnidit
images = engine.generate(["a handwritten 7", "the digit three"], SamplingParams(seed=1))
images[0].save("seven.png")  # PIL images, in prompt order; prompt i uses seed + i
images[1].save("three.png")
print(images[0].size)  # (32, 32): the model's default size
