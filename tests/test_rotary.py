"""attention.rotary: the complex-multiply rotation equals diffusers' real form bit for bit, and its rule
(``vector_loop_only``) takes the complex form only where that holds."""

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxPosEmbed

from attention.rotary import TableCache, pair_table, real_form, rotate_pairs, vector_loop_only

# [B, L, H, D]: FLUX head sizes (64, 128; the complex form), odd pair counts (the real form), and sizes past
# the grain whose thread shares do or do not fall on whole vector steps
SHAPES = [(8, 80, 6, 64), (2, 272, 6, 64), (1, 1040, 3, 128), (3, 17, 5, 128), (1, 7, 1, 6), (2, 5, 3, 12),
          (3, 9, 1, 20), (2, 33, 3, 24), (1, 13, 5, 2), (1, 2051, 3, 64), (1, 1025, 2, 64), (5, 99, 7, 32)]


def tables(length: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(length, dim // 2, generator=g, dtype=torch.float64) * 400
    return angle.cos().float().repeat_interleave(2, -1), angle.sin().float().repeat_interleave(2, -1)


def raw_complex(x, table):
    xf = x.float().contiguous()
    return torch.view_as_real(torch.view_as_complex(xf.unflatten(-1, (-1, 2))) * table).flatten(-2).to(x.dtype)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_diffusers_real_form(threads, dtype):
    for n in (1, 2, 3, 4):
        threads(n)
        for i, shape in enumerate(SHAPES):
            x = (torch.randn(*shape, generator=torch.Generator().manual_seed(i)) * 5).to(dtype)
            cos, sin = tables(shape[1], shape[-1], i)
            ref = apply_rotary_emb(x, (cos, sin), sequence_dim=1)
            table = pair_table(cos, sin)[None, :, None, :]
            got = rotate_pairs(x, table, cos[None, :, None, :], sin[None, :, None, :])
            assert got.dtype == dtype and torch.equal(got, ref), (n, shape, dtype)
            exact = vector_loop_only(x.numel() // 2, shape[-1] // 2)
            if i < 4:  # the FLUX shapes do take the complex form
                assert exact, (n, shape)
            if not torch.equal(raw_complex(x, table), ref):  # where the complex form differs, the rule refuses it
                assert not exact, (n, shape, dtype)


def test_rule_follows_the_thread_shares(threads):
    threads(2)
    assert vector_loop_only(8 * 80 * 6 * 32, 32)
    assert not vector_loop_only(8 * 80 * 6 * 3, 3)  # a pair row that is not whole vector steps
    threads(3)
    assert not vector_loop_only(16 * 4099, 16)  # 3 shares of 21862 (not a multiple of 16)
    assert vector_loop_only(48 * 4096, 16)
    assert vector_loop_only(16 * 1000, 16)  # under the grain: one thread


def test_per_row_and_per_token_tables(threads):
    threads(2)
    rows, length, heads, dim = 3, 40, 4, 64
    x = torch.randn(rows, length, heads, dim)
    per_row = [tables(length, dim, s) for s in range(rows)]
    cos, sin = torch.stack([c for c, _ in per_row]), torch.stack([s for _, s in per_row])
    ref = torch.stack([apply_rotary_emb(x[r:r + 1], per_row[r], sequence_dim=1)[0] for r in range(rows)])
    got = rotate_pairs(x, pair_table(cos, sin)[:, :, None, :], cos[:, :, None, :], sin[:, :, None, :])
    assert torch.equal(got, ref)
    flat, fc, fs = x.flatten(0, 1), cos.flatten(0, 1), sin.flatten(0, 1)  # one table row per token
    assert torch.equal(rotate_pairs(flat, pair_table(fc, fs)[:, None, :], fc[:, None, :], fs[:, None, :]),
                       ref.flatten(0, 1))
    assert torch.equal(real_form(flat, fc[:, None, :], fs[:, None, :]), ref.flatten(0, 1))


def test_flux_position_tables_repeat_each_pair():
    """pair_table reads every other entry: FLUX's own tables hold each pair's value twice."""
    ids = torch.cat([torch.zeros(7, 3), torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(5.), torch.arange(6.),
                                                                   indexing="ij"), -1).flatten(0, 2)])
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=[16, 24, 24])(ids)
    assert torch.equal(cos[:, 0::2], cos[:, 1::2]) and torch.equal(sin[:, 0::2], sin[:, 1::2])
    x = torch.randn(2, ids.shape[0], 3, 64)
    got = rotate_pairs(x, pair_table(cos, sin)[None, :, None, :], cos[None, :, None, :], sin[None, :, None, :])
    assert torch.equal(got, apply_rotary_emb(x, (cos, sin), sequence_dim=1))


def test_table_cache_builds_once_per_pair_of_tables():
    cache, (cos, sin) = TableCache(), tables(9, 8, 0)
    first = cache.get(cos, sin)
    assert cache.get(cos, sin) is first
    assert cache.get(cos.clone(), sin) is not first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wan_rotation_equals_its_real_form(dtype):
    """Wan's rotate (the complex form where it applies) against its real form on Wan's own tables."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    from dit_core.families.processors.wan import real_rotate, rotate

    cos, sin = WanRotaryPosEmbed(64, (1, 2, 2), 1024)(torch.zeros(1, 16, 3, 8, 10))  # [1, L, 1, D]
    assert torch.equal(cos[..., 0::2], cos[..., 1::2]) and torch.equal(sin[..., 0::2], sin[..., 1::2])
    x = (torch.randn(2, cos.shape[1], 4, 64) * 5).to(dtype)
    assert vector_loop_only(x.numel() // 2, 32)
    assert torch.equal(rotate(x, cos, sin), real_rotate(x, cos, sin))


def test_benchmark_quick_writes_every_key(tmp_path, monkeypatch):
    import json

    from benchmarks import common, rotary

    # into a temporary folder: the committed results/rotary_quick.json stays the run that was committed
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rotary.main(["--quick"])
    summary = json.loads((tmp_path / "rotary_quick.json").read_text())["summary"]
    for dtype in ("float32", "bfloat16"):
        for length in (80, 768):
            assert summary[f"complex_over_real_speed_{dtype}_{length}"] > 0
    assert summary["bit_identical"] is True and summary["complex_form_taken"] is True


def test_tables_other_than_float32_take_the_real_form():
    """The complex table is complex64: float64 tables (which the real form computes in float64) keep it."""
    cos, sin = (t.double() for t in tables(80, 64, 1))
    x = torch.randn(2, 80, 3, 64)
    c4, s4 = cos[None, :, None, :], sin[None, :, None, :]
    got = rotate_pairs(x, pair_table(cos, sin)[None, :, None, :], c4, s4)
    assert torch.equal(got, real_form(x, c4, s4))
