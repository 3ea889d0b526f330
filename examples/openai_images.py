"""Images over HTTP with the stock OpenAI client (start a server first: `make run`)."""

import base64
import os

import openai

client = openai.OpenAI(base_url=os.environ.get("OMNIDIT_URL", "http://127.0.0.1:8000") + "/v1",
                       api_key=os.environ.get("OMNIDIT_API_KEY", "KEY or anything"))
r = client.images.generate(model="digits", prompt="a handwritten 7", size="32x32", n=2, response_format="b64_json",
                           extra_body={"num_inference_steps": 20, "seed": 1})
for i, image in enumerate(r.data):
    open(f"7_{i}.png", "wb").write(base64.b64decode(image.b64_json))
print(len(r.data), "images")
