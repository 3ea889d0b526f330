"""Several models in one engine: one step loop, one scheduler; a request names its model."""

from dit_core import Engine, SamplingParams
from dit_core.zoo import default_model, default_video_model

engine = Engine.from_models({"digits": default_model(), "moving": default_video_model()})
image = engine.generate("a handwritten 7", SamplingParams(seed=1), model="digits")[0]
video = engine.generate("the digit 7 moving right", SamplingParams(seed=1), model="moving")[0]
print(sorted(engine.models), image.size, len(video))  # ['digits', 'moving'] (32, 32) 9
