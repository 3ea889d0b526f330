"""Request and response bodies of the HTTP API; requests turn themselves into engine parameters."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from dit_core import InvalidParamError, SamplingParams
from dit_core.params import MAX_IMAGES, MAX_LORAS_PER_REQUEST

MAX_N = 10  # images per HTTP request (the engine allows more; GET /v1/models/{id} states the lower one)


class LoraRef(BaseModel):
    """One adapter of a request's ``lora`` list: a name loaded on the server (``GET /v1/loras``) and its scale."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=128)
    scale: float = Field(1.0, allow_inf_nan=False, description="its weight, as diffusers' set_adapters takes "
                                                               "it (0: the model without it)")


def _json_text(value):
    """A form (image edits, the openai client's video requests) sends the ``lora`` list as JSON text."""
    if isinstance(value, str):
        import json

        try:
            return json.loads(value)
        except ValueError:
            raise ValueError('expected a list of {"name", "scale"} objects (in a form: as JSON text)') from None
    return value


LoraList = Annotated[Annotated[list[LoraRef], Field(max_length=MAX_LORAS_PER_REQUEST)] | None,
                     BeforeValidator(_json_text),
                     Field(description=f"LoRA adapters loaded on the server to apply, up to "
                                       f"{MAX_LORAS_PER_REQUEST}: [{{\"name\": ..., \"scale\": ...}}]; several "
                                       "compose (the sum of their scaled deltas)")]


def lora_pairs(refs: list[LoraRef] | None) -> tuple:
    """``SamplingParams.loras`` of a body's ``lora`` list (400 naming ``lora`` for a name given twice, or too many)."""
    if not refs:
        return ()
    names = [r.name for r in refs]
    if len(set(names)) != len(names) or len(names) > MAX_LORAS_PER_REQUEST:
        raise InvalidParamError("lora", names, f"up to {MAX_LORAS_PER_REQUEST} adapters, each named once")
    return tuple((r.name, r.scale) for r in refs)


def _integral(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def json_int(ge: int, le: int):
    """An integer field in [ge, le] of a strict body. JSON Schema's ``integer`` takes 5.0 as 5, and so does
    this ("5", true and 5.5 stay errors, as strict mode has them)."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


class ImageRequestFields(BaseModel):
    """What the image routes share: OpenAI's fields, plus omnidit's extension fields. Unknown fields are
    errors."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    size: str | None = Field(None, description='"WIDTHxHEIGHT" (e.g. "512x512") or "auto"; with an input image, '
                                               "auto is the image's size rounded down to the model's multiple")
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = Field(
        "png", description="the images' file format (OpenAI's field): png (lossless), jpeg or webp")
    output_compression: int | None = Field(
        None, ge=0, le=100, description="with output_format jpeg or webp: the encoder's quality, 0-100 (default "
                                        "100, OpenAI's default; PNG is lossless and takes none)")
    user: str | None = None
    stream: bool = False
    # extensions
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    seed: int | None = None
    max_sequence_length: int | None = None
    use_cache: bool = True
    lora: LoraList = None
    strength: float | None = Field(None, gt=0, le=1, allow_inf_nan=False,
                                   description="with an input image: the fraction of the schedule to run "
                                               "(diffusers' img2img strength; default 0.6)")

    @field_validator("output_compression")
    @classmethod
    def _compression_needs_a_lossy_format(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("output_format", "png") == "png":
            raise ValueError("expected unset with output_format 'png' (lossless): it is for 'jpeg' or 'webp'")
        return value

    def size_pixels(self) -> tuple[int | None, int | None]:
        if self.size in (None, "auto"):
            return None, None
        parts = self.size.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise InvalidParamError("size", self.size, '"WIDTHxHEIGHT" such as "512x512", or "auto"')
        return int(parts[0]), int(parts[1])

    def sampling_params(self, image=None, mask=None) -> SamplingParams:
        """The engine parameters; ``image`` and ``mask``: the decoded inputs (serve.image_uploads)."""
        width, height = self.size_pixels()
        return SamplingParams(loras=lora_pairs(self.lora), height=height, width=width,
                              num_inference_steps=self.num_inference_steps,
                              guidance_scale=self.guidance_scale, true_cfg_scale=self.true_cfg_scale,
                              negative_prompt=self.negative_prompt, seed=self.seed, num_outputs=self.n,
                              max_sequence_length=self.max_sequence_length, use_cache=self.use_cache,
                              image=image, mask=mask, strength=self.strength)


class ImageGenerationRequest(ImageRequestFields):
    """OpenAI's images.generate body, plus omnidit's extension fields (``image``: an earlier output)."""

    # strict: 0 is not false and "1" is not 1 (a JSON body says what it means)
    model_config = ConfigDict(extra="forbid", strict=True)

    image: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]], Field(
        min_length=1, max_length=MAX_IMAGES)] | None = Field(
        None, description="pictures to start from (image-to-image) or to edit: an earlier output of this server (the "
                          "file id, or the url, that response_format=url answered with) or a picture inline as a "
                          "base64 data URL (data:image/png;base64,...; the body is bounded by --max-body-bytes); a "
                          f"list of up to {MAX_IMAGES} for models that take several pictures (reference-image "
                          "editing)")


class ImageEditRequest(ImageRequestFields):
    """The text fields of ``POST /v1/images/edits`` (a multipart form: values arrive as strings, so
    not strict: "2" is 2, "true" is true). The files (image, image[], mask) are read by the route."""


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: Literal["png", "jpeg", "webp"] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omnidit"
    kind: str = "image"  # what the model makes: image | video | audio | actions


class ModelDetail(ModelCard):
    """``GET /v1/models/{id}``: the card plus the family's defaults and limits."""

    details: dict


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
