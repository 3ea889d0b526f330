"""The LoRA hook on one layer (dit_core.adapters.apply): it adds exactly each row's scaled low-rank deltas
on top of whatever kernel the layer computes with (aten, oneDNN-packed, int8), leaves rows without an
adapter bit-identical, and both ways of adding a batch's deltas (``segmented``, ``stacked``) give each
row what it gets alone. The engine-level LoRA tests are in test_lora.py."""

import pytest
import torch


@pytest.mark.parametrize("base", ["aten", "packed", "int8-weight"])
def test_deltas_wrap_the_existing_layer_kernel(base):
    """The hook adds exactly the scaled low-rank delta to the adapted rows, on top of whatever the
    layer computes (its own kernel: aten, oneDNN-packed, int8); other rows are left bit-identical."""
    import quant
    from torch import nn

    from dit_core import cpu_linear
    from dit_core.adapters import Adapter, LoraWeights, RowAdapters, apply

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48))
    if base == "packed":
        if not torch.backends.mkldnn.is_available():
            pytest.skip("torch built without oneDNN")
        model[0] = cpu_linear.PackedLinear(model[0])
    elif base != "aten":
        quant.quantize_module(model, base, "cpu")
    layer = model[0]
    kind = type(layer)
    store = object()
    apply.install(store, {"0": layer})
    assert type(model[0]) is kind  # the layer itself stays
    x = torch.randn(4, 5, 32)
    with torch.no_grad():
        plain = model(x)
        A, B = torch.randn(3, 32), torch.randn(48, 3)
        adapter = Adapter("t", "t", {"0": LoraWeights(A, B, 2.0)})
        ctx = RowAdapters(4, [(adapter, torch.tensor([1, 3]), torch.tensor([0.5, -1.0]))])
        with apply.active(store, ctx):
            got = model(x)
        again = model(x)
    assert torch.equal(again, plain)  # outside the forward's context: no delta
    assert torch.equal(got[[0, 2]], plain[[0, 2]])  # rows without an adapter pay nothing, change nothing
    for row, s in ((1, 0.5), (3, -1.0)):
        expected = plain[row] + (x[row] @ A.t() @ B.t()) * 2.0 * s
        assert (got[row] - expected).abs().max().item() <= 1e-4


def per_row_reference(layer, x, assignment):
    """Each row alone through ``layer`` plus its adapters' deltas in PEFT's order (``lora_B(lora_A(x)) *
    scaling * scale``, summed over the row's adapters), float64."""
    out = []
    for row, pairs in enumerate(assignment):
        xr = x[row:row + 1].double()
        y = layer(x[row:row + 1]).double()
        for w, s in pairs:
            y = y + (xr @ w.A.double().t()) @ w.B.double().t() * w.scaling * s
        out.append(y)
    return torch.cat(out)


@pytest.mark.parametrize("strategy", ["segmented", "stacked"])
def test_strategies_equal_per_row_application(strategy, monkeypatch):
    """Both ways of adding a batch's deltas (per adapter, per run of its rows; or all rows at once through
    stacked factors) give each row its own adapters' deltas (composed, per-row scales, rows without any
    untouched, an adapter of another rank in the batch, one missing on the layer), and a row's result
    is the same in the batch as alone."""
    from torch import nn

    from dit_core.adapters import Adapter, LoraWeights, RowAdapters, apply

    monkeypatch.setattr(apply, "STRATEGY", strategy)
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    store = object()
    apply.install(store, {"l": layer})

    def lora(r, scaling):
        return LoraWeights(torch.randn(r, 24) * 0.3, torch.randn(40, r) * 0.3, scaling)

    p, q, other = (Adapter(n, n, {"l": lora(4, 2.0)}) for n in "pqo")
    other.layers["l"] = lora(2, 0.5)  # another rank: the stacked form falls back for this layer's pass
    absent = Adapter("z", "z", {"elsewhere": lora(4, 1.0)})  # no factors on this layer
    rows = [[(p, 1.0)], [], [(q, 0.5), (p, -1.0)], [(p, 0.6)], [(absent, 1.0)], [(q, 1.0)], []]

    def ctx_of(assignment):
        groups: dict = {}
        for row, pairs in enumerate(assignment):
            for a, s in pairs:
                groups.setdefault(a.name, (a, [], []))[1].append(row)
                groups[a.name][2].append(s)
        return RowAdapters(len(assignment), [(a, torch.tensor(i), torch.tensor(s)) for a, i, s in groups.values()])

    sparse = [[(p, 1.0)], [], [], [], [(q, 0.5)], []]  # rows with adapters: less than half of their span
    for assignment in (rows, [pairs + ([(other, 0.7)] if i == 3 else []) for i, pairs in enumerate(rows)], sparse):
        x = torch.randn(len(assignment), 5, 24)
        with torch.no_grad():
            with apply.active(store, ctx_of(assignment)):
                got = layer(x)
            ref = per_row_reference(layer, x, [[(a.layers["l"], s) for a, s in pairs if "l" in a.layers]
                                               for pairs in assignment])
            assert (got.double() - ref).abs().max().item() <= 1e-5
            plain = layer(x)
            for row, pairs in enumerate(assignment):  # rows without factors on the layer: untouched
                if not any("l" in a.layers for a, _ in pairs):
                    assert torch.equal(got[row], plain[row])
            for row, pairs in enumerate(assignment):  # the row alone, through the same path
                with apply.active(store, ctx_of([pairs])):
                    alone = layer(x[row:row + 1])
                assert (got[row] - alone[0]).abs().max().item() <= 1e-6, f"row {row}"
            with apply.active(store, ctx_of(assignment)):  # again: the kept stacks (stacked) give the same
                assert torch.equal(layer(x), got)
    if strategy == "stacked":  # an adapter unloaded: no kept stack holds it any more
        assert any(a is p for e in apply._STACKS.values() for a in e.adapters)
        apply.forget(p)
        assert not any(a is p for e in apply._STACKS.values() for a in e.adapters)
