"""Edit an image over HTTP with the stock OpenAI client (start a server first: `make run`): draw a 7,
turn it into a 1 (image-to-image), then repaint only its right half (inpainting, OpenAI's mask)."""

import base64
import io
import os

import openai
from PIL import Image

client = openai.OpenAI(base_url=os.environ.get("OMNIDIT_URL", "http://127.0.0.1:8000") + "/v1",
                       api_key=os.environ.get("OMNIDIT_API_KEY", "KEY or anything"))
seven = client.images.generate(model="digits", prompt="a handwritten 7", size="32x32",
                               extra_body={"seed": 1}).data[0].b64_json
open("seven.png", "wb").write(base64.b64decode(seven))

# image-to-image: strength is the fraction of the schedule to run (0.3 keeps the digit, 0.9 follows the prompt)
one = client.images.edit(model="digits", image=open("seven.png", "rb"), prompt="the digit 1",
                         extra_body={"strength": 0.9, "seed": 2})
open("one.png", "wb").write(base64.b64decode(one.data[0].b64_json))

# inpainting: the mask's fully transparent pixels (alpha 0) mark where to edit, the rest is kept
mask = Image.new("RGBA", (32, 32), (0, 0, 0, 255))
mask.paste((0, 0, 0, 0), (16, 0, 32, 32))
buf = io.BytesIO()
mask.save(buf, format="PNG")
half = client.images.edit(model="digits", image=open("seven.png", "rb"), mask=("mask.png", buf.getvalue(), "image/png"),
                          prompt="the digit 4", extra_body={"strength": 1.0, "seed": 3})
open("inpainted.png", "wb").write(base64.b64decode(half.data[0].b64_json))
print("wrote seven.png, one.png, inpainted.png")
