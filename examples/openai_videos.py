"""Videos over HTTP with the stock OpenAI client's Videos API (a server with `--model digits_video`)."""

import os

import openai

client = openai.OpenAI(base_url=os.environ.get("OMNIDIT_URL", "http://127.0.0.1:8000") + "/v1", api_key="unused")
video = client.videos.create_and_poll(model="digits_video", prompt="the digit 5 moving up", size="32x32",
                                      extra_body={"seed": 1, "num_frames": 9})
print(video.status, video.progress)  # completed 100
open("five.mp4", "wb").write(client.videos.download_content(video.id).read())
