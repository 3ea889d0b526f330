"""``offload.reuse``: kept buffers go back to the system once idle, and the cached library is
loaded only when its record verifies it. Everything that installs the allocator runs in its own
process (it is process-wide and cannot be uninstalled); building alone runs here."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dit_core import EngineConfig, InvalidParamError
from offload import reuse

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20

IDLE_SCRIPT = """
import json, time, torch
from offload import reuse
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
w = torch.randn(512, 8192) / 32  # the weights: live throughout
def layers(rows):  # a model's forward: temporaries of rows x 8192 and rows x 512 floats, freed as it goes
    x = torch.randn(rows, 512)
    for _ in range(2):
        x = (torch.nn.functional.gelu(x @ w) @ w.T + x).softmax(-1)
    return x.sum().item()
def large_request():  # 8-128 MiB temporaries: kept by the allocator once freed
    return layers(4096)
def small_request():  # 1-16 MiB temporaries
    return layers(512)
out = {"said": reuse.choose("reuse", on_cpu=True, idle_s=0)}
small_request()
time.sleep(0.5)
out["idle"] = rss()
large_request()
out["held"], out["held_stats"] = rss(), reuse.installed()
time.sleep(1.5)
out["kept_with_0"] = rss()  # idle_s=0: kept until a miss needs the room (the behaviour before)
out["said_again"] = reuse.install(idle_s=0.3)  # a new bound applies to what is kept already
time.sleep(1.5)
out["after_setting"], out["after_setting_stats"] = rss(), reuse.installed()
# the second large request runs under a 2 s bound: one of its matmuls takes ~0.4 s here (more on a loaded
# machine), so at 0.3 s a buffer freed by the first layer is idle long enough to be unmapped while the
# request still runs, and what is held after it depends on the machine's load (seen: 127 of 128 MiB)
reuse.install(idle_s=2.0)
large_request()
out["held_again"] = rss()
time.sleep(3.0)
out["after_again"], out["after_again_stats"] = rss(), reuse.installed()
small_request()  # a steady stream, each request within idle_s of the last, keeps reusing its mappings
start, before = time.monotonic(), reuse.installed()
while time.monotonic() - start < 1.2:
    small_request()
    time.sleep(0.05)
after = reuse.installed()
out["steady"] = {k: after[k] - before[k] for k in ("hits", "misses", "resizes", "idle_unmaps")}
print(json.dumps(out))
"""


def _run(script: str, *args, env_extra: dict | None = None, timeout: int = 240) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env_extra or {}))
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kept_buffers_go_back_to_the_system_once_idle():
    """After a large request (8-128 MiB temporaries) the allocator holds >= 128 MiB more than the
    idle process did; with ``idle_s=0`` it still does 1.5 s later (the old behaviour, now an
    opt-out); with a bound of 0.3 s the RSS falls back to within 8 MiB of the idle RSS measured
    before the request (every kept mapping unmapped, ``cached`` 0), both for buffers kept before
    the bound was set and after a second large request. A steady stream of small requests
    (each within the bound of the last) keeps being served from kept mappings: no fresh or
    resized mapping and nothing unmapped for idleness."""
    got = _run(IDLE_SCRIPT)
    assert "never unmapped for idleness" in got["said"], got["said"]
    assert "unmapped after 0.3 s unused" in got["said_again"], got["said_again"]
    idle = got["idle"]
    assert got["held"] - idle >= 128 * MIB and got["held_stats"]["cached"] >= 128 * MIB, got
    assert got["kept_with_0"] - idle >= 128 * MIB, got
    for phase in ("after_setting", "after_again"):
        stats = got[f"{phase}_stats"]
        assert got[phase] - idle <= 8 * MIB, (phase, got)
        assert stats["cached"] == 0 and stats["mapped"] == stats["live"] and stats["idle_unmaps"] > 0, (phase, got)
        assert stats["idle_ms"] == (300 if phase == "after_setting" else 2000)
    assert got["held_again"] - idle >= 128 * MIB, got  # the second large request was kept too, then given back
    steady = got["steady"]
    assert steady["hits"] > 0 and steady["misses"] == steady["resizes"] == steady["idle_unmaps"] == 0, got


ENGINE_SCRIPT = """
import json, sys, time
from dit_core import Engine, SamplingParams
from offload import reuse
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
e = Engine.from_pretrained(sys.argv[1], cpu_allocator="auto", cpu_allocator_idle_s=0.5, cpu_linear="aten")
def generate(size, n):
    p = SamplingParams(height=size, width=size, num_inference_steps=2, seed=1, max_sequence_length=16,
                       output_type="pt")
    return len(e.generate(["a cat"] * n, p))
generate(64, 1)
time.sleep(1.2)
idle = rss()
generate(256, 4)
held, held_stats = rss(), reuse.installed()
time.sleep(1.5)
print(json.dumps({"idle": idle, "held": held, "held_stats": held_stats, "after": rss(),
                  "after_stats": reuse.installed()}))
"""


def test_engine_rss_falls_back_after_a_large_request(tiny_models):
    """An engine on CPU (``cpu_allocator="auto"`` installs the reuse allocator) with
    ``cpu_allocator_idle_s=0.5``: a 4-image 256x256 request after 64x64 ones leaves >= 16 MiB kept
    (the VAE's activations), enough for the RSS fall below to be measured; 1.5 s later every kept
    mapping is unmapped, the RSS fell by at least what was kept, and it is within 32 MiB of the idle
    RSS before the request (measured: ~18 MiB, the glibc heap's share of the request, not this
    allocator's). What is still kept when ``held`` is read depends on the machine and its load: >= 32
    MiB on an AVX-512 EPYC; 29 MiB in three quiet runs on a 2-core AVX2-only EPYC (2026-12-03) and 25
    MiB there under the two-worker suite, whose slower request leaves more of the kept mappings idle
    past the 0.5 s bound before ``held`` is read (11 idle unmaps by then)."""
    got = _run(ENGINE_SCRIPT, tiny_models["flux"])
    kept = got["held_stats"]["cached"]
    assert kept >= 16 * MIB, got
    assert got["after_stats"]["cached"] == 0 and got["after_stats"]["idle_ms"] == 500, got
    assert got["held"] - got["after"] >= kept - 4 * MIB, got
    assert got["after"] - got["idle"] <= 32 * MIB, got


def test_idle_bound_is_an_engine_setting_and_a_flag():
    """``cpu_allocator_idle_s`` is validated as an ``EngineConfig`` field (a clear error naming it)
    and ``--cpu-allocator-idle-s`` reaches it through ``engine_kwargs``, the options every entry
    point (in-process server, ``--replicas``) builds its ``EngineConfig`` from."""
    from serve.cli import build_parser
    from serve.cli_engine_args import engine_kwargs

    assert EngineConfig().cpu_allocator_idle_s == reuse.IDLE_S
    assert EngineConfig(cpu_allocator_idle_s=0).cpu_allocator_idle_s == 0.0
    for bad in (-1, float("inf"), float("nan"), "5", True):
        with pytest.raises(InvalidParamError) as e:
            EngineConfig(cpu_allocator_idle_s=bad)
        assert e.value.field == "cpu_allocator_idle_s"
    args = build_parser().parse_args(["serve", "some-model", "--cpu-allocator-idle-s", "2.5"])
    options = engine_kwargs(args)
    assert options["cpu_allocator_idle_s"] == 2.5 and EngineConfig(**options).cpu_allocator_idle_s == 2.5
    default = engine_kwargs(build_parser().parse_args(["serve", "some-model"]))
    assert default["cpu_allocator_idle_s"] == reuse.IDLE_S


# ---- the cached library's integrity ------------------------------------------------------------

@pytest.fixture
def counted_compiler(tmp_path, monkeypatch):
    """``CXX``: a wrapper around the system compiler that logs each compile (its ``--version`` is the
    compiler's), and a fresh ``OMNIDIT_CACHE_DIR``; returns a function counting compiles so far."""
    real = shutil.which("g++") or shutil.which("c++")
    if real is None:
        pytest.skip("no C++ compiler on this machine (the allocator cannot be built here)")
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -o "*) echo compile >> "{log}";; esac\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("OMNIDIT_CACHE_DIR", str(tmp_path / "cache"))
    return lambda: len(log.read_text().splitlines()) if log.exists() else 0


def _record(so: Path) -> dict:
    return json.loads(so.with_suffix(".json").read_text())


def test_cached_library_is_rebuilt_when_it_or_its_record_does_not_verify(counted_compiler, tmp_path, monkeypatch):
    """A build is cached with a record (source hash, torch build, compiler identity, flags, and the
    library's own hash) and reused while all of these match; a truncated library, a record whose
    hash was changed, and a changed source are each rebuilt, not loaded."""
    so = reuse.build()
    assert counted_compiler() == 1
    record = _record(so)
    assert record["so_sha256"] == hashlib.sha256(so.read_bytes()).hexdigest()
    assert record["inputs"]["source_sha256"] == hashlib.sha256(reuse.SOURCE.read_bytes()).hexdigest()
    assert "git=" in record["inputs"]["torch"] and record["inputs"]["compiler"].strip()
    good = so.read_bytes()
    assert reuse.build() == so and counted_compiler() == 1  # verified: reused as is

    so.write_bytes(good[: len(good) // 2])  # truncated
    assert reuse.build() == so and counted_compiler() == 2 and so.read_bytes() == good

    changed = dict(_record(so), so_sha256="0" * 64)  # the record no longer vouches for the file
    so.with_suffix(".json").write_text(json.dumps(changed))
    assert reuse.build() == so and counted_compiler() == 3 and _record(so) == record

    so.with_suffix(".json").unlink()  # no record at all
    assert reuse.build() == so and counted_compiler() == 4 and _record(so) == record

    source = tmp_path / "reuse_allocator.cpp"
    source.write_text(reuse.SOURCE.read_text() + "\n// another revision\n")
    monkeypatch.setattr(reuse, "SOURCE", source)
    other = reuse.build()
    assert other != so and counted_compiler() == 5
    assert _record(other)["inputs"]["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()


LOAD_SCRIPT = """
import json, torch
from offload import reuse
said = reuse.choose("reuse", on_cpu=True)
x = torch.ones(4 << 20)  # 16 MiB through the allocator
del x
maps = open("/proc/self/maps").read()
print(json.dumps({"said": said, "stats": reuse.installed(), "from_memfd": "omnidit-reuse-allocator" in maps,
                  "cache_file_mapped": str(reuse.cache_dir()) in maps}))
"""


def test_corrupt_cached_library_is_rebuilt_then_installed(counted_compiler):
    """A process that finds the cached library corrupt (garbage of the same size: loading it would
    fail or worse) rebuilds it and installs the allocator; what it loads are the bytes it verified
    (an in-memory copy, not the cache file that could change after the check)."""
    so = reuse.build()
    good = so.read_bytes()
    so.write_bytes(b"\x7fELF" + bytes(len(good) - 4))
    got = _run(LOAD_SCRIPT)
    assert got["said"].startswith("reuse allocator installed"), got
    assert got["stats"]["misses"] >= 1 and got["stats"]["cached"] >= 16 * MIB, got
    assert counted_compiler() == 2 and so.read_bytes() == good
    assert got["from_memfd"] and not got["cache_file_mapped"], got
