"""offload/: every policy computes what ``none`` computes; the disk tier bounds memory; prefetch
overlaps compute; a missing or truncated weight file fails the start or the request, by name."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dit_core import Engine, InvalidParamError, RequestFailedError, UnknownModelError
from dit_core.offloading import offload_of
from offload import heap, reuse
from helpers import CFG, assert_finished, params, run_staggered
from procs import run_together

# every policy on every family (components with the host tier, and the disk tier, on each); the
# variants of N and components with the disk tier on one
CASES = [(f, p) for f in ("flux", "sd3", "qwenimage") for p in ("components,blocks:1", "disk:1")] + \
    [("flux", "blocks:all"), ("flux", "components,disk:2")]
# a step cache that really skips rows on the tiny checkpoints (sd3 has no TeaCache coefficients)
CACHE_ON = {"flux": "teacache:0.6", "qwenimage": "teacache:0.6", "sd3": "fbcache:0.6"}
ROOT = Path(__file__).resolve().parents[1]
# In-process engines leave the pytest process's malloc and torch's CPU allocator alone: the disk
# tier's "auto" threshold and reuse allocator are process-wide and cannot be undone. The
# subprocess tests below (peak memory, heap, reuse allocator) run with the default "auto".
KEEP_HEAP = {"malloc_mmap_threshold": 0, "cpu_allocator": "system"}


def mixed(family):
    cfg = CFG[family]
    return [("a cat", params(num_inference_steps=4, seed=1, **cfg)),
            ("a dog in a field", params(num_inference_steps=2, seed=2)),
            ("x", params(num_inference_steps=3, seed=3, num_outputs=2, **cfg))]


def run_all(engine, family):
    """One request alone, then a continuously batched mixed set (staggered arrivals, CFG and not)."""
    single, _ = run_staggered(engine, [("a lighthouse", params(num_inference_steps=2, seed=7))], arrivals=[0])
    batched, sizes = run_staggered(engine, mixed(family), arrivals=[0, 1, 1])
    assert max(sizes) == 3
    return [assert_finished(single[0])] + [assert_finished(batched[i]) for i in range(3)]


@pytest.fixture(scope="module")
def references(tiny_models):
    cache = {}

    def get(family, step_cache):
        if (family, step_cache) not in cache:
            # aten linears, as the streamed engines run them (cpu_linear packs resident weights only)
            engine = Engine.from_pretrained(tiny_models[family], cache=step_cache, cpu_linear="aten")
            cache[family, step_cache] = run_all(engine, family), engine.stats.block_evals
        return cache[family, step_cache]

    return get


@pytest.mark.parametrize("family,policy", CASES)
def test_every_policy_computes_what_none_computes(family, policy, tiny_models, references):
    """Same values, not always the same bits: ``none`` computes with weights mapped from the
    safetensors file (pointers 8-byte aligned), a streamed block with weights in 64-byte
    aligned slots, and the CPU GEMM kernels round differently by alignment (measured: the same
    model with its weights cloned to aligned memory matches streaming bit for bit)."""
    for step_cache in ("none", CACHE_ON[family]):
        ref, ref_evals = references(family, step_cache)
        engine = Engine.from_pretrained(tiny_models[family], offload=policy, cache=step_cache, **KEEP_HEAP)
        got = run_all(engine, family)
        for i, (a, b) in enumerate(zip(got, ref)):
            diff = (a - b).abs().max().item()
            assert diff <= 1e-6, f"{family} {policy} cache={step_cache} request {i}: {diff}"
        assert engine.stats.block_evals == ref_evals  # the same rows skipped the same blocks
        handle = offload_of(engine.family)
        stats = handle.stats()
        if "components" in policy:
            assert all(s["calls"] > 0 for s in stats["components"].values())  # the hooks ran
        if handle.blocks is not None and not handle.blocks.keep_all:
            assert stats["loads"] >= engine.stats.steps  # blocks really streamed, step after step
            assert len(handle.blocks.resident_blocks()) <= handle.blocks.nslots
        engine.close()
    if step_cache != "none":
        assert ref_evals < engine.stats.block_evals_full  # the cache did skip work


@pytest.fixture(scope="module")
def small_flux(tmp_path_factory):
    from dit_core.random_models import build

    return build("flux", "small", tmp_path_factory.mktemp("small") / "flux-small")


def test_disk_tier_peak_memory_is_bounded(small_flux):
    """``disk:1`` on the small FLUX checkpoint, each side in its own process (peak RSS from
    VmHWM): the issue's bound, the peak stays below ``none``'s by at least the transformer's
    weight size minus 2 blocks. What the tier really holds is less (its non-block weights, the
    mapped computing part of a block and one ``WARM_CHUNK`` of the block ahead), but identical
    runs' peaks differ by a few MiB (allocator), and a tighter bound failed CI by 1.5 MiB; the
    tighter figure is reported on failure."""
    from offload.mapped import WARM_CHUNK

    model = small_flux
    none, disk = _peaks_in_subprocesses(model, ("none", "disk:1"))
    assert disk["stats"]["loads"] >= 2 * disk["blocks"]  # every block was read from disk, every step
    assert disk["stats"]["map_s"] > 0  # blocks came up warmed, and were mapped on the compute thread
    need = disk["transformer_bytes"] - 2 * disk["max_block_bytes"]
    held = disk["nonblock_bytes"] + disk["max_part_bytes"] + WARM_CHUNK
    saved = none["peak"] - disk["peak"]
    assert saved >= need, (f"saved {saved / 2**20:.1f} MiB, needed {need / 2**20:.1f} MiB (the tier "
                           f"holds about {held / 2**20:.1f} MiB of weights; {none}, {disk})")
    # the disk tier on CPU fixed glibc's mmap threshold ("auto"); none left glibc alone
    assert (disk["mmap_threshold"], none["mmap_threshold"]) == (heap.DEFAULT_THRESHOLD, None)
    # ... and served its activations from the reuse allocator ("auto"): mostly from kept buffers
    kept = disk["stats"]["cpu_allocator"]
    assert kept["hits"] > 4 * kept["misses"] and kept["mapped_peak"] <= max(
        kept["live_peak"] + kept["slack"], 2 * kept["live_peak"]), kept
    assert kept["slack"] == reuse.SLACK_STREAMING  # streaming blocks: the small slack (resident: reuse.SLACK)


HEAP_SCRIPT = """
import json, sys, torch
from offload import heap
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
said = heap.apply("auto", sys.argv[1] == "disk")
big = torch.empty(30 << 18).fill_(1)  # 30 MiB, mapped and freed: glibc's dynamic threshold rises to it
del big
t = torch.empty(24 << 18).fill_(1)  # 24 MiB of activations
before = rss()
del t
print(json.dumps({"said": said, "applied": heap.applied(), "returned": before - rss()}))
"""


def _heap_run(mode, **env_extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_extra)
    if not env_extra:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
        env.pop("GLIBC_TUNABLES", None)
    out = subprocess.run([sys.executable, "-c", HEAP_SCRIPT, mode], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_mmap_threshold_returns_freed_activations_to_the_os():
    """Under glibc's dynamic threshold a freed 24 MiB tensor stays resident (carved from the heap
    once a larger block was freed); with ``heap.apply("auto", disk_on_cpu=True)`` it has its own
    mapping and freeing it gives it back. With ``MALLOC_MMAP_THRESHOLD_`` in the environment,
    "auto" leaves the threshold to the environment."""
    glibc, fixed = _heap_run("none"), _heap_run("disk")
    assert "not changed" in glibc["said"] and glibc["applied"] is None
    assert "fixed at 1048576" in fixed["said"] and fixed["applied"] == heap.DEFAULT_THRESHOLD
    assert glibc["returned"] < 4 << 20 and fixed["returned"] >= 20 << 20, (glibc, fixed)
    env = _heap_run("disk", MALLOC_MMAP_THRESHOLD_=str(4 << 20))
    assert "left to the environment (MALLOC_MMAP_THRESHOLD_)" in env["said"] and env["applied"] is None


REUSE_SCRIPT = """
import json, resource, sys, torch
from offload import reuse
said = reuse.choose("auto", on_cpu=True)
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def layer(x, w):  # a block's worth of activations: 4-16 MiB temporaries, freed as it goes
    h = torch.nn.functional.gelu(x @ w)
    return (h @ w.T + x).softmax(-1)
torch.manual_seed(0)
x, w = torch.randn(1024, 1024), torch.randn(1024, 4096) / 64
outs, counts = [], []
for rep in range(4):
    before, start = reuse.installed(), faults()
    y = x
    for _ in range(4):
        y = layer(y, w)
    conv = torch.nn.functional.conv2d(torch.randn(2, 16, 96, 96), torch.randn(16, 16, 3, 3))  # raw_allocate users
    after = reuse.installed()
    outs.append(y.sum().item())
    counts.append({k: after[k] - before[k] for k in ("misses", "resizes", "hits")} | {"faults": faults() - start})
stats = reuse.installed()
held = rss()
reuse.trim()
print(json.dumps({"said": said, "outs": outs, "counts": counts, "stats": stats, "trimmed": held - rss(),
                  "after_trim": reuse.installed()}))
"""


def test_reuse_allocator_slack_follows_the_offload_policy(tiny_models):
    """Weights resident: the kept buffers may exceed the live peak by ``reuse.SLACK`` (mixed shapes at 256x256
    resize kept buffers less); streaming blocks: by ``reuse.SLACK_STREAMING``, where activations are most of
    what the process holds. The allocator is process-wide: the last engine started sets it."""
    if reuse.choose("auto", True).startswith("system"):
        pytest.skip("the reuse allocator cannot be built here")
    Engine.from_pretrained(tiny_models["flux"]).close()
    assert reuse.installed()["slack"] == reuse.SLACK == 128 << 20
    Engine.from_pretrained(tiny_models["flux"], offload="blocks:1").close()
    assert reuse.installed()["slack"] == reuse.SLACK_STREAMING == 32 << 20
    Engine.from_pretrained(tiny_models["flux"]).close()
    assert reuse.installed()["slack"] == reuse.SLACK


def test_reuse_allocator_serves_repeats_from_kept_buffers(tmp_path):
    """``offload.reuse`` (built here with the C++ compiler): a repeated workload is served from
    kept mappings (no fresh or resized mapping, and far fewer page faults than its first pass),
    computes the same, keeps what it maps within the live peak + slack (or twice the live peak),
    and ``trim`` gives the kept memory back."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMNIDIT_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", REUSE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["said"].startswith("reuse allocator installed"), got["said"]
    first, last = got["counts"][0], got["counts"][-1]
    assert first["misses"] > 0 and last["misses"] == last["resizes"] == 0 and last["hits"] >= first["misses"], got
    assert last["faults"] * 4 < first["faults"], got["counts"]
    assert len(set(got["outs"])) == 1  # the same arithmetic on kept buffers
    stats = got["stats"]
    assert stats["mapped_peak"] <= max(stats["live_peak"] + stats["slack"], 2 * stats["live_peak"]), stats
    assert got["trimmed"] >= stats["cached"] // 2 and got["after_trim"]["cached"] == 0, got
    assert list((tmp_path / "cache" / "ext").glob("reuse_allocator-*.so"))  # the cached build


def test_reuse_allocator_matches_system_outputs_and_falls_back(small_flux, tmp_path):
    """The disk tier under the reuse allocator ("auto") produces the images the system allocator
    does, and so does an engine without offload, which "auto" also gives the allocator (the allocator
    is process-wide: the two "auto" engines share one process, the system one has its own); without a
    compiler "auto" falls back and says why, and an explicit "reuse" fails the engine's start naming
    ``cpu_allocator``. All three run aten linears (``cpu_linear`` packs resident weights only) and
    aten's GELU (the process without a compiler cannot build ``dit_core.cpu_gelu``'s kernel, so the
    others put aten's back), so the images must agree bit for bit."""
    script = ("import json, sys, torch\n"
              "from dit_core import Engine, InvalidParamError, SamplingParams, cpu_gelu\n"
              "from offload import reuse\n"
              "p = SamplingParams(height=64, width=64, num_inference_steps=2, seed=3, max_sequence_length=16,"
              " output_type='pt')\n"
              "for offload in sys.argv[4].split(','):\n"
              "    e = Engine.from_pretrained(sys.argv[1], offload=offload, cpu_allocator=sys.argv[3],"
              " cpu_linear='aten')\n"
              "    cpu_gelu.restore(e.family.transformer)\n"
              "    torch.save(torch.stack(e.generate(['a cat', 'a dog'], p)), f'{sys.argv[2]}-{offload}.pt')\n"
              "    assert (reuse.installed() or {}).get('hits', 0) > 0 if sys.argv[3] == 'auto' else "
              "reuse.installed() is None\n"
              "    del e\n"
              # the system-allocator process (no compiler on its PATH) also checks the fallback: "auto" says
              # why it falls back, an explicit "reuse" fails the engine's start naming cpu_allocator
              "if sys.argv[3] == 'system':\n"
              "    said = reuse.choose('auto', on_cpu=True)\n"
              "    try:\n"
              "        Engine.from_pretrained(sys.argv[1], malloc_mmap_threshold=0, cpu_allocator='reuse')\n"
              "        field = message = None\n"
              "    except InvalidParamError as err:\n"
              "        field, message = err.field, str(err)\n"
              "    print(json.dumps({'said': said, 'field': field, 'message': message,"
              " 'installed': reuse.installed()}))\n")
    # "none" first: it alone installs the allocator. The system-allocator process has no compiler and a cache
    # of its own, so the two processes run together
    def command(allocator, offloads):
        return [sys.executable, "-c", script, str(small_flux), str(tmp_path / allocator), allocator, offloads]

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    system_env = dict(env, CXX=str(tmp_path / "no-such-compiler"), OMNIDIT_CACHE_DIR=str(tmp_path / "empty-cache"))
    outs = run_together([(command("auto", "none,disk:1"), env), (command("system", "disk:1"), system_env)])
    outputs = dict(zip(("auto", "system"), outs))
    images = [torch.load(tmp_path / f"{allocator}-{offload}.pt")
              for allocator, offload in (("auto", "disk:1"), ("system", "disk:1"), ("auto", "none"))]
    assert torch.equal(images[0], images[1]) and torch.equal(images[0], images[2])
    got = json.loads(outputs["system"].strip().splitlines()[-1])
    assert got["said"].startswith("system allocator (the reuse allocator is unavailable"), got
    assert "no-such-compiler" in got["said"] and got["field"] == "cpu_allocator" and got["installed"] is None
    assert "no-such-compiler" in got["message"], got  # refused for the missing compiler, nothing else


PEAK_SCRIPT = """
import json, sys
from dit_core import Engine, SamplingParams
from dit_core.offloading import offload_of
from offload import heap
from offload import find_blocks, heap
engine = Engine.from_pretrained(sys.argv[1], offload=sys.argv[2])
engine.generate(["a cat", "a dog"], SamplingParams(height=64, width=64, num_inference_steps=2, seed=0,
                                                   max_sequence_length=16, output_type="pt"))
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
tr = engine.family.transformer
blocks = [m for _, m in find_blocks(tr)]
size = lambda ps: sum(p.numel() * p.element_size() for p in ps)
ids = {id(p) for b in blocks for p in b.parameters()}
handle = offload_of(engine.family)
print(json.dumps({"peak": peak, "blocks": len(blocks), "transformer_bytes": size(tr.parameters()),
                  "nonblock_bytes": size(p for p in tr.parameters() if id(p) not in ids),
                  "max_block_bytes": max(size(b.parameters()) for b in blocks),
                  "max_part_bytes": max(size(p for p in m._parameters.values() if p is not None)
                                        for b in blocks for m in b.modules()),
                  "slot_bytes": handle.blocks.slot_bytes if handle else 0,
                  "stats": handle.stats() if handle else {}, "mmap_threshold": heap.applied()}))
"""


def _peaks_in_subprocesses(model, policies):
    """Each policy's peak in its own process (VmHWM is per process), the processes run together."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    outs = run_together([([sys.executable, "-c", PEAK_SCRIPT, str(model), policy], env) for policy in policies])
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


class SlowSource:
    """Wraps a block source: each load sleeps ``delay`` seconds (a slow disk)."""

    def __init__(self, inner, delay):
        self.inner, self.delay, self.tier = inner, delay, inner.tier

    def host_tensors(self, k):
        return None

    def read_into(self, k, outs):
        time.sleep(self.delay)
        return self.inner.read_into(k, outs)


def test_prefetch_overlaps_compute(tiny_models):
    """With loads and block computes of 40 ms each (sleeps), block k+1 loads while block k computes:
    the loader's and the blocks' own timestamps overlap, and the forward waits far less than it loads."""
    engine = Engine.from_pretrained(tiny_models["flux"], offload="disk:1", **KEEP_HEAP)
    streamer = offload_of(engine.family).blocks
    streamer.source = SlowSource(streamer.source, 0.04)
    for block in streamer.blocks:  # slow compute: a hook after each block (runs inside its forward)
        block.register_forward_hook(lambda *_: time.sleep(0.04), prepend=True)
    streamer.stats.trace = []
    engine.generate("a cat", params(num_inference_steps=4, seed=1))
    trace = streamer.stats.trace
    loads = [(b, s, e) for kind, b, s, e in trace if kind == "load"]
    computes = [(b, s, e) for kind, b, s, e in trace if kind == "compute"]
    n = len(streamer.blocks)
    assert len(computes) == 4 * n and len(loads) >= len(computes)
    # every load after the first ran while another block was computing
    overlapped = sum(any(s < ce and cs < e and cb != b for cb, cs, ce in computes) for b, s, e in loads[1:])
    assert overlapped >= len(computes) - 1
    load_s = sum(e - s for _, s, e in loads[:len(computes)])
    assert streamer.stats.wait_s < 0.5 * load_s
    for step in range(4):  # each step's blocks, from the first one's start to the last one's end,
        run = computes[step * n:(step + 1) * n]  # took at least half its loads' time less than serially
        span = run[-1][2] - run[0][1]
        step_loads = sum(e - s for _, s, e in loads[step * n:(step + 1) * n])
        serial = sum(e - s for _, s, e in run) + step_loads
        assert span <= serial - 0.5 * step_loads, (step, span, serial, step_loads)


def _copy_model(src, dst):
    return Path(shutil.copytree(src, dst))


def test_missing_or_truncated_weight_file_fails_the_start(tiny_models, tmp_path):
    model = _copy_model(tiny_models["flux"], tmp_path / "flux")
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(UnknownModelError, match="truncated") as e:
        Engine.from_pretrained(model, offload="disk:1", **KEEP_HEAP)
    assert str(weights) in str(e.value)
    weights.unlink()
    with pytest.raises(UnknownModelError, match="missing") as e:
        Engine.from_pretrained(model, offload="blocks:1")
    assert str(weights) in str(e.value)


@pytest.mark.parametrize("dtype,source", [("float32", "MappedSource"), ("bfloat16", "DiskSource")])
def test_weight_file_lost_mid_run_fails_the_request_not_the_engine(dtype, source, tiny_models, tmp_path):
    """Both disk paths: mapped (file dtype = model dtype, on CPU) and read into slots (here with a
    conversion from the fp32 file to bf16)."""
    model = _copy_model(tiny_models["flux"], tmp_path / "flux")
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    engine = Engine.from_pretrained(model, offload="disk:1", dtype=dtype, **KEEP_HEAP)
    assert type(offload_of(engine.family).blocks.source).__name__ == source
    p = params(num_inference_steps=3, seed=4)
    good = engine.generate("a cat", p)[0]
    # the same kernels without offload: streaming keeps aten's linears (no packing, so no bf16 GELU fusion)
    plain = Engine.from_pretrained(model, dtype=dtype, cpu_linear=engine.family.cpu_linear).generate("a cat", p)[0]
    assert (good.float() - plain.float()).abs().max().item() <= 1e-6
    weights.rename(weights.with_suffix(".moved"))
    with pytest.raises(RequestFailedError, match="missing") as e:
        engine.generate("a cat", p)
    assert str(weights) in str(e.value)
    weights.with_suffix(".moved").rename(weights)
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(RequestFailedError, match="truncated") as e:
        engine.generate("a cat", p)
    assert str(weights) in str(e.value)
    weights.write_bytes(data)  # back: the same engine serves again, and identically
    assert torch.equal(engine.generate("a cat", p)[0], good)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("field,value,match", [
    ("offload", "disk:0", "disk:N with an integer N >= 1"), ("offload", "tape", "parts among"),
    ("offload", "blocks:1,disk:1", "at most one"), ("offload", "none,components", "'none' alone"),
    ("offload", 3, "a string"), ("max_resident_gb", -1, "GiB > 0"), ("max_resident_gb", "1", "GiB > 0"),
    ("malloc_mmap_threshold", "big", "'auto', 0"), ("malloc_mmap_threshold", -1, "'auto', 0"),
    ("malloc_mmap_threshold", 1 << 30, "up to 33554432"),
    ("cpu_allocator", "jemalloc", "one of \\['auto', 'system', 'reuse'\\]"),
])
def test_bad_offload_settings_name_the_field(field, value, match, tiny_models):
    with pytest.raises(InvalidParamError, match=match) as e:
        Engine.from_pretrained(tiny_models["flux"], **{field: value})
    assert e.value.field == field


def test_memory_budget_picks_the_blocks_held(small_flux):
    from offload import find_blocks

    model = small_flux
    probe = Engine.from_pretrained(model, cpu_linear="aten")  # plain Linear parameters to count
    tr = probe.family.transformer
    blocks = [m for _, m in find_blocks(tr)]
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    block = max(size(b.parameters()) for b in blocks)
    others = sum(size(m.parameters()) + size(m.buffers()) for k, m in probe.family.components.items()
                 if isinstance(m, torch.nn.Module) and k != "transformer")
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    fixed = size(p for p in tr.parameters() if id(p) not in in_blocks) + size(tr.buffers()) + others
    threshold = heap.applied()  # what earlier engines of this pytest process fixed (disk tiers do)
    tight = Engine.from_pretrained(model, max_resident_gb=(fixed + 2.5 * block) / 2**30, **KEEP_HEAP)
    handle = offload_of(tight.family)
    assert (str(handle.policy), handle.blocks.nslots, handle.blocks.keep_all) == ("disk", 2, False)  # disk on CPU
    assert heap.applied() == threshold  # KEEP_HEAP: the process's threshold untouched by this engine
    roomy = Engine.from_pretrained(model, offload="blocks", max_resident_gb=1.0)
    assert offload_of(roomy.family).blocks.keep_all
    with pytest.raises(InvalidParamError, match="at least") as e:
        Engine.from_pretrained(model, max_resident_gb=(fixed + block) / 2**30, **KEEP_HEAP)
    assert e.value.field == "max_resident_gb"
    p = params(height=64, width=64, num_inference_steps=2, seed=2, max_sequence_length=16)
    assert (tight.generate("a cat", p)[0] - probe.generate("a cat", p)[0]).abs().max().item() <= 1e-6


def test_cli_passes_offload_settings():
    from serve.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", "x", "--offload", "components,disk:2", "--max-resident-gb", "1.5"])
    kwargs = engine_kwargs(args)
    assert (kwargs["offload"], kwargs["max_resident_gb"], kwargs["malloc_mmap_threshold"]) == (
        "components,disk:2", 1.5, "auto")
    assert kwargs["cpu_allocator"] == "auto"
    args = build_parser().parse_args(["generate", "x", "--malloc-mmap-threshold", "0", "--cpu-allocator", "system"])
    assert (engine_kwargs(args)["malloc_mmap_threshold"], engine_kwargs(args)["cpu_allocator"]) == (0, "system")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--malloc-mmap-threshold", "lots"])


def test_block_streaming_with_quant_is_refused_by_name(tiny_models):
    """Quantized layers are built from loaded weights; streamed blocks have none at load."""
    with pytest.raises(InvalidParamError, match="quant") as e:
        Engine.from_pretrained(tiny_models["flux"], offload="disk:1", quant="int8-weight")
    assert e.value.field == "offload"
