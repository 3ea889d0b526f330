"""FLUX.1 Kontext: reference-image editing as diffusers' ``FluxKontextPipeline`` does it, inside the
batched step loop.

A request on a Kontext checkpoint is one of three kinds, told apart by its fields:

* text to image (no ``image``): exactly as ``FluxFamily``;
* image-to-image / inpainting (``image`` with ``strength`` or ``mask``): the image is the start, as
  ``FluxImg2ImgPipeline`` / ``FluxInpaintPipeline`` (``image_inputs.py``);
* an edit (``image`` alone): the image is a *reference*. Its packed latents are appended to the
  generated image tokens, with their own position ids (first component 1, then row and column of
  the reference's own token grid); the transformer's output is cut back to the generated tokens.

What the pipeline does, matched here:

* the reference's size: the image's, rounded down to the size multiple; then (``_auto_resize``, on by
  default) the entry of ``PREFERRED_KONTEXT_RESOLUTIONS`` (about one megapixel each) whose aspect ratio
  is closest, whatever the image's own size; the image is resized to it (PIL: Lanczos) and scaled to
  [-1, 1]. A checkpoint turns that off with ``"_omnidit_kontext": {"auto_resize": false}`` in its
  model_index.json (the pipeline's ``_auto_resize=False``): the reference keeps its own size.
* the reference latent is the VAE encoder's mode (``sample_mode="argmax"``), so the request's noise is
  its generator's first draw;
* the scheduler's shift ``mu`` counts only the generated tokens; guidance as FLUX.
* output size: the pipeline fits ``height`` x ``width`` (default its text-to-image size) to
  ``max_area`` (default 1024^2) keeping the aspect ratio. Here ``height`` / ``width`` are used as
  given (the pipeline's result with ``max_area=height*width``); without them an edit takes the
  reference's size (the pipeline takes its square default).

Batching: rows with references of different token counts (and text-to-image rows, with none) share
a step. The image stream of each row is [generated tokens, its reference tokens]; rows of one shape
(output size, text length, reference grid: ``row_shape``) run as the transformer's own batch. Rows of
different shapes share ONE packed forward when the engine mixes sizes (``mixed_sizes``, the default:
``flux_packed`` appends each row's reference tokens, every linear runs once over the step's real tokens,
attention per row with its own rotary table; no padding); the output is cut back to the generated
tokens. Where sizes are kept apart (``mixed_sizes`` off, or compile, LoRA, block offload:
``dit_core.mixed_sizes``) rows of one output size with different reference lengths either share ONE
forward, right-padded to the longest row (attention gets the validity mask, so it runs packed on the
valid tokens with a varlen backend or masked otherwise: ``attention.attend``; each row gets its own
rotary table), or run as one forward per reference length, whichever costs fewer token rows: the
token-wise layers (linears, norms) run over the padded rectangle, so padding pays off only while it is
a small share (``PAD_SHARE``). Padded tokens never reach a valid one; either way a row gets what it gets
alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import PIL.Image
import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

from ..errors import InvalidParamError, UnknownModelError
from ..params import SamplingParams, describe_image
from ..request import Request
from .base import BlockInputs, split_rows
from .flux import FluxFamily, image_ids
from .image_inputs import _processor_input, first_image, image_size, scaled_latents
from .latents import pack_2x2
from .packed_rows import DenseRows, RowTokens

OPTIONS_KEY = "_omnidit_kontext"  # model_index.json: {"auto_resize": bool}
# Without packing (sizes kept apart): one padded forward while its token rows exceed those of one forward
# per length group by at most this share (each extra forward has its own fixed cost and smaller GEMMs).
# Measured on the small FLUX Kontext (benchmarks/edits.py, 2 cores, 8 mixed requests): at 64x64 (64 text,
# 16 image, 15-16 reference tokens) padding adds ~14%, the rows share one forward: x2.10 of diffusers; at
# 256x256 (256 image, 240-256 reference tokens) padding would add ~50%: one padded forward ran x1.02
# (--quick), one forward per length group x1.29 (text-to-image alone: x1.54 in the same run). Packed (the
# default) against mixed_sizes=False, interleaved on the AVX2 EPYC: 64x64 mix 1.91 s vs 2.16 s (padded);
# 256x256 mix 9.13 s vs 8.65 s (per length): the packed forward's varied buffer sizes make the CPU reuse
# allocator resize / miss ~25 times a forward at its 32 MiB slack (22-43k page faults); at 128 MiB none,
# and packed equals per length (1.12 s vs 1.13 s a step).
PAD_SHARE = 0.25


@dataclass
class ReferenceInputs:
    """An edit request's reference image, preprocessed at its own size."""

    pixels: torch.Tensor  # [1, 3, h, w] in [-1, 1]


def is_edit(params: SamplingParams) -> bool:
    """An image without strength or mask is a reference (an edit), not a start image."""
    return params.image is not None and params.strength is None and params.mask is None


class FluxKontextFamily(FluxFamily):
    name = "flux_kontext"
    pipeline_class = "FluxKontextPipeline"
    # packed (``EngineConfig.mixed_sizes``): ``flux_packed`` appends each row's reference tokens to its image
    # stream; rows of different sizes, text lengths or reference grids share one forward without padding
    packable = True

    def __init__(self, components, dtype, device, checkpoint=None):
        super().__init__(components, dtype, device, checkpoint)
        options = (checkpoint or {}).get(OPTIONS_KEY) or {}
        unknown = set(options) - {"auto_resize"}
        if unknown or not isinstance(options.get("auto_resize", True), bool):
            raise UnknownModelError(f"{OPTIONS_KEY} in model_index.json takes only auto_resize (true or false); "
                                    f"got {options!r}")
        self.auto_resize = options.get("auto_resize", True)

    def input_kinds(self) -> list[str]:
        return super().input_kinds() + ["reference_images"]

    # ---- the reference image, per request ----

    def reference_size(self, image) -> tuple[int, int]:
        """(height, width) the pipeline resizes a reference image to."""
        m = self.size_multiple
        h, w = image_size(image)
        h, w = h - h % m, w - w % m  # VaeImageProcessor.get_default_height_width
        if not h or not w:
            raise InvalidParamError("image", describe_image(image), f"at least {m} pixels per side")
        if self.auto_resize:
            aspect = w / h
            _, w, h = min((abs(aspect - pw / ph), pw, ph) for pw, ph in PREFERRED_KONTEXT_RESOLUTIONS)
        return h // m * m, w // m * m

    def resolve(self, params: SamplingParams) -> SamplingParams:
        if not is_edit(params):
            return super().resolve(params)
        image = first_image(params, self.name)
        h, w = self.reference_size(image)
        params = params.with_defaults(height=h, width=w)
        return replace(super().resolve(replace(params, image=None)), image=params.image)

    def validate_input(self, value, params: SamplingParams):
        if not is_edit(params):
            return super().validate_input(value, params)
        text, _ = super().validate_input(value, replace(params, image=None))
        image = first_image(params, self.name)
        h, w = self.reference_size(image)
        picture = _processor_input(image, False)
        if isinstance(picture, PIL.Image.Image):  # the pipeline resizes, then preprocesses (no-op resize)
            picture = self.processor.resize(picture, h, w)
        pixels = self.processor.preprocess(picture, height=h, width=w)
        return text, ReferenceInputs(pixels.to(torch.float32))

    def row_tokens(self, prompt: str, params: SamplingParams, inputs=None) -> int:
        extra = 0
        if isinstance(inputs, ReferenceInputs):
            extra = (inputs.pixels.shape[2] // self.size_multiple) * (inputs.pixels.shape[3] // self.size_multiple)
        return super().row_tokens(prompt, params, inputs) + extra

    def row_shape(self, req: Request) -> tuple:
        """A dense batch's rows share the output size, text length and reference grid (or have none)."""
        ref = req.inputs.pixels.shape[2:] if isinstance(req.inputs, ReferenceInputs) else None
        return super().row_shape(req) + (None if ref is None else tuple(ref),)

    def batch_key(self, params: SamplingParams) -> tuple:
        key = super().batch_key(params)
        if self.parallel is not None:  # processes split the sequence: no padded rows there
            key += (self.reference_size(first_image(params, self.name)) if is_edit(params) else None,)
        return key

    def encode(self, requests: list[Request]) -> None:
        """Prompts and start images (``FluxFamily``), then the references: VAE-encoded together per
        reference size, in calls of at most ``decode_pixel_budget`` pixels."""
        super().encode(requests)
        refs = [r for r in requests if isinstance(r.inputs, ReferenceInputs)]
        if refs:
            start = time.perf_counter()
            calls = self.encode_references(refs)
            record = getattr(self, "on_encode", None)  # the engine's stats (set by Engine)
            if record is not None:
                record(len(refs), calls, time.perf_counter() - start)

    @torch.no_grad()
    def encode_references(self, requests: list[Request]) -> int:
        by_size: dict[tuple, list[Request]] = {}
        for req in requests:
            by_size.setdefault(tuple(req.inputs.pixels.shape[2:]), []).append(req)
        calls = 0
        for (h, w), group in by_size.items():
            per_call = max(1, self.decode_pixel_budget // (h * w))
            for i in range(0, len(group), per_call):
                chunk = group[i:i + per_call]
                pixels = torch.cat([r.inputs.pixels for r in chunk]).to(device=self.device, dtype=self.dtype)
                moments = self.vae_moments(pixels)
                calls += 1
                for j, req in enumerate(chunk):
                    mode = DiagonalGaussianDistribution(moments[j:j + 1]).mode()
                    latents = scaled_latents(self.vae, mode).to(self.dtype)
                    ids = image_ids(latents.shape[2] // 2, latents.shape[3] // 2)
                    ids[:, 0] = 1
                    req.state["reference"] = pack_2x2(latents)
                    req.state["reference_ids"] = ids.to(self.device, self.dtype)
        return calls

    # ---- every step ----

    def transformer_inputs(self, requests: list[Request]) -> dict:
        """FLUX's inputs with each row's reference tokens appended to its image tokens. When all rows
        carry the same reference grid (or none), these are the transformer's own arguments; otherwise
        rows are right-padded and ``valid`` marks each row's real tokens of the joint sequence."""
        inputs = super().transformer_inputs(requests)
        if "layout" in inputs:  # packed: ``flux_packed`` appended the references
            return inputs
        latents, ids = inputs["hidden_states"], inputs["img_ids"]
        owners = [req for req in requests for _ in range(req.rows)]
        refs = [o.state.get("reference") for o in owners]
        if all(r is None for r in refs):
            return inputs
        grids = {tuple(o.state["reference_ids"].shape) if r is not None else None for o, r in zip(owners, refs)}
        if len(grids) == 1 and all(torch.equal(o.state["reference_ids"], owners[0].state["reference_ids"])
                                   for o in owners):
            inputs["hidden_states"] = torch.cat([latents, torch.cat(refs).to(latents.dtype)], dim=1)
            inputs["img_ids"] = torch.cat([ids, owners[0].state["reference_ids"]])
            return inputs
        n, rows = latents.shape[1], latents.shape[0]
        lengths = [0 if r is None else r.shape[1] for r in refs]
        total = n + max(lengths)
        hidden = latents.new_zeros(rows, total, latents.shape[2])
        row_ids = ids.new_zeros(rows, total, 3)
        hidden[:, :n], row_ids[:, :n] = latents, ids
        text = inputs["encoder_hidden_states"].shape[1]
        valid = torch.zeros(rows, text + total, dtype=torch.bool, device=latents.device)
        for i, (owner, ref, length) in enumerate(zip(owners, refs, lengths)):
            if ref is not None:
                hidden[i, n:n + length] = ref[0].to(latents.dtype)
                row_ids[i, n:n + length] = owner.state["reference_ids"]
            valid[i, :text + n + length] = True
        inputs.update(hidden_states=hidden, img_ids=row_ids, valid=valid)
        return inputs

    def forward_groups(self, requests: list[Request]) -> list[list[Request]]:
        """The forwards of one step. Rows grouped by length (text + generated + reference tokens) are
        merged in order of length while padding the merged rows to the longest adds at most
        ``PAD_SHARE`` token rows; each merged group is one forward. Counted in ``forwards``: "padded"
        (forwards over rows of different lengths) and "by_length" (steps split into several); "packed"
        counts the packed forwards of ``predict``."""
        text = requests[0].params.max_sequence_length + requests[0].latents.shape[1]  # text + generated tokens
        length = {r.id: text + (r.state["reference"].shape[1] if "reference" in r.state else 0) for r in requests}
        by_length: dict[int, list[Request]] = {}
        for req in requests:
            by_length.setdefault(length[req.id], []).append(req)
        groups, rows, exact = [], 0, 0
        for tokens in sorted(by_length):
            reqs = by_length[tokens]
            n = sum(r.rows for r in reqs)
            if groups and (rows + n) * tokens <= (1 + PAD_SHARE) * (exact + n * tokens):
                groups[-1] += reqs
                rows, exact = rows + n, exact + n * tokens
            else:
                groups.append(list(reqs))
                rows, exact = n, n * tokens
        counts = self.__dict__.setdefault("forwards", {"padded": 0, "by_length": 0, "packed": 0})
        counts["padded"] += sum(len({length[r.id] for r in g}) > 1 for g in groups)
        counts["by_length"] += int(len(groups) > 1)
        return groups if len(groups) > 1 else [requests]

    @torch.no_grad()
    def predict(self, requests: list[Request]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One packed forward for rows of several shapes (``mixed_sizes``), cut back to each request's
        generated tokens; otherwise the dense forward(s) of ``forward_groups``."""
        if self.packs(requests):
            self.__dict__.setdefault("forwards", {"padded": 0, "by_length": 0, "packed": 0})["packed"] += 1
            out = []
            for req, (cond, uncond) in zip(requests, super().predict(requests)):
                n = req.latents.shape[1]
                out.append((cond[:, :n], None if uncond is None else uncond[:, :n]))
            return out
        groups = self.forward_groups(requests)
        if len(groups) == 1:
            return self.predict_rows(requests)
        out, totals = {}, {}
        for group in groups:
            out.update({r.id: o for r, o in zip(group, self.predict_rows(group))})
            for key, value in (getattr(self.step_cache, "last", None) or {}).items():  # the step's cache stats
                totals[key] = totals.get(key, 0) + value
        if totals:
            self.step_cache.last = totals
        return [out[r.id] for r in requests]

    def predict_rows(self, requests: list[Request]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One forward, as FLUX's, on the extended image stream; padded batches run the block loop
        (per-row positions and the validity mask); the output is cut back to the generated tokens."""
        inputs = self.transformer_inputs(requests)
        if self.step_cache is not None:
            out = self.step_cache.forward(self, inputs, requests)
        elif "valid" in inputs:
            x = self.block_inputs(inputs)
            img, _ = self.run_blocks(x, 0, self.num_blocks)
            out = self.head(x.with_streams(img, None))
        elif self.parallel is not None:
            out = self.parallel.forward(inputs)
        else:
            out = self.transformer(**inputs, return_dict=False)[0]
        return split_rows(out[:, :requests[0].latents.shape[1]], requests)

    def block_inputs(self, inputs: dict) -> BlockInputs:
        if "layout" in inputs:  # packed rows: where each row's generated tokens are (``cache_signal``)
            x = super().block_inputs(inputs)
            pos, counts = x.layout.output_tokens("txt", "img")  # the generated tokens, in [text; image] order
            x.shared["generated"] = (RowTokens(counts, x.img.device), pos - x.rows_of("txt").total)
            return x
        ids = inputs["img_ids"]
        if "valid" not in inputs:
            x = super().block_inputs(inputs)
            x.shared["generated"] = int((ids[:, 0] == 0).sum())
            return x
        plain = {k: v for k, v in inputs.items() if k != "valid"}
        x = super().block_inputs({**plain, "img_ids": ids[0]})
        rows, text_ids = ids.shape[0], inputs["txt_ids"]
        joint = torch.cat([text_ids.expand(rows, -1, -1), ids], dim=1)
        cos, sin = self.transformer.pos_embed(joint.flatten(0, 1))
        cos, sin = cos.view(rows, joint.shape[1], -1), sin.view(rows, joint.shape[1], -1)
        return BlockInputs(x.img, x.txt, {**x.rows, "cos": cos, "sin": sin, "valid": inputs["valid"]},
                           {"generated": int((ids[0, :, 0] == 0).sum())})

    def run_block(self, index: int, x: BlockInputs):
        if "valid" not in x.rows:
            return super().run_block(index, x)
        tr = self.transformer
        n_double = len(tr.transformer_blocks)
        block = tr.transformer_blocks[index] if index < n_double else tr.single_transformer_blocks[index - n_double]
        txt, img = block(hidden_states=x.img, encoder_hidden_states=x.txt, temb=x.rows["temb"],
                         image_rotary_emb=(x.rows["cos"], x.rows["sin"]),
                         joint_attention_kwargs={"valid": x.rows["valid"]})
        return img, txt

    def cache_signal(self, x: BlockInputs) -> torch.Tensor:
        """TeaCache's signal on the generated tokens only: a row's decisions must not depend on its
        reference's padding (its batchmates), and are the same in a dense, padded or packed batch."""
        if x.layout is not None:
            return super().cache_signal(x).index_select(0, x.shared["generated"][1])
        return super().cache_signal(x)[:, :x.shared["generated"]]

    def signal_rows(self, x: BlockInputs) -> DenseRows:
        return x.shared["generated"][0] if x.layout is not None else super().signal_rows(x)
