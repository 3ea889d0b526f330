"""AsyncEngine: a background step loop and one event stream per request."""

import asyncio

from dit_core import AsyncEngine, SamplingParams
from dit_core.zoo import default_model


async def main():
    engine = AsyncEngine.from_pretrained(default_model())
    try:
        async for event in engine.stream("a handwritten 5", SamplingParams(num_inference_steps=4, seed=1)):
            print(event.kind.value, event.step, event.total)  # step 1..4, then finished
        output = await engine.generate("the digit six", SamplingParams(seed=2))
        output.images[0].save("six.png")
    finally:
        engine.shutdown(drain_timeout_s=10)


asyncio.run(main())
