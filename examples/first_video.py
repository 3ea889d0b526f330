"""Your first video: the embedded moving-digits model (a Wan-shaped text-to-video model), written as an MP4."""

from dit_core import Engine, SamplingParams
from dit_core.video import write_mp4
from dit_core.zoo import default_video_model

engine = Engine.from_pretrained(default_video_model())
(video,) = engine.generate("the digit 3 moving left", SamplingParams(seed=1))  # 9 frames of 32x32
write_mp4("three.mp4", video, fps=8)
print(len(video), "frames")
