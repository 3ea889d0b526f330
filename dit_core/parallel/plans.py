"""Parallel plans: per family, as plain data, what the generic code in ``sharding.py`` splits.

A plan says:

* ``heads``: where the model keeps its attention head count (Ulysses splits heads; checked at start).
* ``attention``: per attention role, where the text tokens sit in the sequence the processor
  hands to ``attention.attend`` (``front``: [text, image]; ``back``: [image, text]; ``None``: image
  only). Roles listed here run sequence-parallel; a role not listed must not see a split sequence.
  ``{"local": True}``: the role's queries are this rank's image tokens and its keys and values are
  whole on every rank (cross attention to the text), so it runs as it is, with no communication.
* ``rows``: the transformer's keyword arguments that carry one entry per batch row (split across
  row groups); every other argument is replicated.
* ``forward``: module path inside the transformer -> how its inputs (``Shard`` by keyword, or by
  position for a module its parent calls with positional arguments) or its output (``Shard`` /
  ``Gather``) are split across the sequence ranks during a plain forward.
* ``blocks``: for the block loop the step caches drive (``Family.run_blocks``), how the
  ``BlockInputs`` are split: ``img`` along the sequence, entries of ``shared`` by spec, entries of
  ``rows`` named in the optional ``rows`` by spec after the row split (per-token tensors, e.g. Wan
  TI2V's modulation); ``txt`` and the other per-row tensors are split by rows only.
* ``image_tokens``: the family method giving a request's image-token count, the tokens split over the
  sequence ranks (requests with fewer tokens than sequence ranks are refused).
* ``unsupported``: (attribute path, message): configurations the plan does not cover.

Text tokens are REPLICATED on every sequence rank in all three image families (and Wan, whose text
-- and, for image-to-video checkpoints with an image encoder, the encoder's image tokens -- only
enters through cross attention): only the generated image's (video's) tokens are split. Each rank
projects the full prompt (text is short next to the image: 77-512 tokens against 1,024-16,384),
attends with all text keys locally, and -- because every rank holds every text query -- gets the
text stream's output whole without communication (Ring), or after one all-gather of its head slice
(Ulysses). Sharding text too would need the text length divisible by the degree and, for Qwen-Image,
a padding mask split across ranks; replication keeps attention exact for any prompt length at the
cost of redundant text projections (T/(T+N) of block compute).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """Split the image tokens along ``dim`` over the sequence ranks. ``text``: the tensor is a joint
    sequence with the text ``front`` or ``back`` of the image (only the image part is split);
    ``item``: apply to that item of a tuple output (None: to every item of a tuple)."""

    dim: int
    text: str | None = None
    item: int | None = None


@dataclass(frozen=True)
class Gather:
    """Collect the image tokens along ``dim`` on the row group's leader (other ranks get zeros of
    the full shape: they report nothing, and the model's remaining layers only reshape)."""

    dim: int


_FLUX_ROWS = ("hidden_states", "timestep", "guidance", "pooled_projections", "encoder_hidden_states")

PLANS: dict[str, dict] = {
    # FLUX.1: [text, image] in the double-stream blocks and in the single-stream blocks' joint sequence.
    "flux": {
        "heads": "transformer.config.num_attention_heads",
        "attention": {"joint": {"text": "front"}},
        "rows": _FLUX_ROWS,
        "forward": {
            "": {"inputs": {"hidden_states": Shard(1), "img_ids": Shard(0)}},
            "proj_out": {"output": Gather(1)},
        },
        "blocks": {"img": Shard(1), "shared": {"image_rotary_emb": Shard(0, text="front")}},
        "image_tokens": "latent_tokens",
        "unsupported": (),
    },
    # SD3 / SD3.5: [image, text] in the joint blocks; SD3.5's extra image-only attention is ``self``.
    "sd3": {
        "heads": "transformer.config.num_attention_heads",
        "attention": {"joint": {"text": "back"}, "self": {"text": None}},
        "rows": ("hidden_states", "timestep", "encoder_hidden_states", "pooled_projections"),
        "forward": {
            "pos_embed": {"output": Shard(1)},  # patches become tokens here
            "proj_out": {"output": Gather(1)},  # unpatchify needs the whole grid
        },
        "blocks": {"img": Shard(1), "shared": {}},
        "image_tokens": "latent_tokens",
        "unsupported": (),
    },
    # Qwen-Image: [text, image]; text padded per batch with a mask on text keys only.
    "qwenimage": {
        "heads": "transformer.config.num_attention_heads",
        "attention": {"joint": {"text": "front"}},
        "rows": ("hidden_states", "timestep", "guidance", "encoder_hidden_states",
                 "encoder_hidden_states_mask", "img_shapes"),
        "forward": {
            "": {"inputs": {"hidden_states": Shard(1)}},
            "pos_embed": {"output": Shard(0, item=0)},  # (image freqs, text freqs)
            "proj_out": {"output": Gather(1)},
        },
        "blocks": {"img": Shard(1), "shared": {"image_rotary_emb": Shard(0, item=0)}},
        "image_tokens": "latent_tokens",
        "unsupported": (("transformer.zero_cond_t", "zero_cond_t Qwen-Image checkpoints modulate per image token"),),
    },
    # Wan 2.1 text-to-video: self attention over the video tokens (frames x patches, one flat
    # sequence); cross attention from them to the text. The blocks are called positionally, so the
    # plain forward splits the first block's input (argument 0) and the rotary table (rope's output).
    "wan": {
        "heads": "transformer.config.num_attention_heads",
        "attention": {"self": {"text": None}, "cross": {"local": True}},
        "rows": ("hidden_states", "timestep", "encoder_hidden_states"),
        "forward": {
            "rope": {"output": Shard(1)},  # (cos, sin), each [1, tokens, 1, head_dim]
            "blocks.0": {"inputs": {0: Shard(1)}},
            "proj_out": {"output": Gather(1)},  # unpatchify needs the whole grid
        },
        "blocks": {"img": Shard(1), "shared": {"rotary": Shard(1)}},
        "image_tokens": "latent_tokens",
        "unsupported": (),
    },
}

# Qwen-Image-Edit: Qwen-Image's transformer. An edit row's image stream is [generated; reference] tokens with
# both grids in ``img_shapes`` (the rotary table's image half covers both), split as one sequence like a
# plain row's; the gathered output is cut back to the generated tokens on rank 0 (``qwen_edit.predict``).
PLANS["qwenimage_edit"] = {**PLANS["qwenimage"], "image_tokens": "sequence_tokens"}
# Qwen-Image-Edit Plus: the same transformer and layout, with one reference block per picture after the
# generated tokens ([generated; ref 1; ref 2; ...], every grid in ``img_shapes``): split as one sequence.
PLANS["qwenimage_edit_plus"] = PLANS["qwenimage_edit"]


# Wan image-to-video (``wan_i2v``): Wan's transformer. The condition channels (first-frame mask and latents) join
# the latents' channels, so the token sequence is the text-to-video one; a checkpoint's image-encoder tokens
# (``encoder_hidden_states_image``) join the cross-attention context in front of the text, keys and values whole
# on every rank like the text's: one more per-row argument, nothing else to split.
PLANS["wan-i2v"] = {**PLANS["wan"], "rows": PLANS["wan"]["rows"] + ("encoder_hidden_states_image",)}
# Wan 2.2 TI2V (``wan_ti2v``): a timestep per video token ([rows, tokens]). The plain forward splits it with the
# tokens before the time embedding, so each rank embeds and modulates with its own tokens' timesteps (blocks and
# output norm); the block loop splits the per-token ``temb`` / ``proj`` rows ([rows, tokens, ...]) the same way.
PLANS["wan-ti2v"] = {
    **PLANS["wan"],
    "forward": {"": {"inputs": {"timestep": Shard(1)}}, **PLANS["wan"]["forward"]},
    "blocks": {**PLANS["wan"]["blocks"], "rows": {"temb": Shard(1), "proj": Shard(1)}},
}


def plan_for(family) -> dict | None:
    return PLANS.get(family.name)
