"""``ImageOnlyQwen2VLProcessor``: transformers' ``Qwen2VLProcessor`` without its video processor.

transformers 5 builds a ``Qwen2VLProcessor`` only with a video processor, whose class needs torchvision,
which does not import on these machines. The Qwen-Image-Edit pipelines pass no videos, so the random
edit checkpoints (``qwenimage`` ``tiny-edit``) save this subclass as their ``processor``: the same text
and image processing (its image processor is the PIL one). model_index.json names it by this module,
which diffusers and omnidit both import to load it."""

from __future__ import annotations

# ProcessorMixin is imported for diffusers: it loads a component of a module outside diffusers/transformers
# with the load method of whichever of its base classes (ProcessorMixin here) that module names
from transformers import ProcessorMixin, Qwen2VLProcessor  # noqa: F401


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # ProcessorMixin takes the sub-processors this signature names: image_processor and tokenizer
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
