"""FLUX's rotary embedding as a complex multiply (``dit_core.families.rotary``) gives diffusers' bits."""

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxPosEmbed

from dit_core.families import rotary


def _tables(tokens: int, dim: int = 64):
    ids = torch.stack([torch.zeros(tokens), torch.arange(tokens) // 7, torch.arange(tokens) % 7], dim=1).float()
    return FluxPosEmbed(theta=10000, axes_dim=[dim // 4, 3 * dim // 8, 3 * dim // 8])(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [6, 3])
def test_same_bits_as_diffusers(dtype, heads):
    torch.manual_seed(0)
    cos, sin = _tables(37)
    assert rotary.pair_table(cos, sin) is not None  # FLUX's tables: one value per pair, the complex path runs
    x = (torch.randn(2, 37, heads, 64) * 4).to(dtype)
    want = apply_rotary_emb(x, (cos, sin), sequence_dim=1)
    assert torch.equal(rotary.rotate(x, cos, sin), want)
    # packed [T, H, D] with a table per token, and per-row [B, S, D] tables: the same bits
    assert torch.equal(rotary.rotate(x[1], cos, sin), want[1])
    assert torch.equal(rotary.rotate(x, cos.expand(2, -1, -1), sin.expand(2, -1, -1)), want)
    # a non-contiguous input (a slice of a joint sequence)
    wide = torch.randn(37, heads, 2, 64).to(dtype)
    assert torch.equal(rotary.rotate(wide[:, :, 1], cos, sin), apply_rotary_emb(wide[None, :, :, 1], (cos, sin),
                                                                                   sequence_dim=1)[0])


def test_tables_without_pairs_use_diffusers_form():
    torch.manual_seed(1)
    cos, sin = torch.rand(9, 8), torch.rand(9, 8)  # pairs differ: no complex form gives these bits
    assert rotary.pair_table(cos, sin) is None
    x = torch.randn(1, 9, 2, 8)
    assert torch.equal(rotary.rotate(x, cos, sin), apply_rotary_emb(x, (cos, sin), sequence_dim=1))
    assert rotary.pair_table(cos.double(), sin.double()) is None  # float64 tables: diffusers computes in float64


def test_table_built_once_per_tables():
    cos, sin = _tables(5)
    table = rotary.pair_table(cos, sin)
    assert rotary.pair_table(cos, sin) is table
    other = _tables(5)
    assert rotary.pair_table(*other) is not table and torch.equal(rotary.pair_table(*other), table)


def test_compiles_to_the_same_bits():
    torch.manual_seed(2)
    cos, sin = _tables(11)
    x = torch.randn(1, 11, 2, 64)
    compiled = torch.compile(rotary.rotate, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, cos, sin), apply_rotary_emb(x, (cos, sin), sequence_dim=1))
