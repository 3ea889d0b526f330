"""Your first speech: the embedded text-to-speech model through the OpenAI client.

Start a server first: `omnidit serve --model tts` (or `make run`, which serves every embedded model).
"""

import os

import openai

client = openai.OpenAI(base_url=os.environ.get("OMNIDIT_URL", "http://127.0.0.1:8000") + "/v1", api_key="unused")
speech = client.audio.speech.create(model="tts", voice="adam", input="3 1 4", response_format="wav")
speech.write_to_file("314.wav")  # 8 kHz mono: "three one four"
print(os.path.getsize("314.wav"), "bytes")
