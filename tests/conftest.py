import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Under `make test`'s pytest-xdist workers, each worker (and every process it starts, which inherits the
# variable) runs torch's intra-op pool on its share of the cores, set before torch is imported: two
# workers at torch's default of one thread per core kept four OpenMP threads spinning on two cores
# (six modules took 295 s that way and 72 s with one thread per worker, on a 2-core EPYC, 2026-12-03).
# A test run alone keeps torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Engines built by tests run their thinker on transformers unless a test chooses one: a vLLM engine
# takes tens of seconds to start, so the vLLM tests share one per session (tests/test_thinker.py).
os.environ.setdefault("OMNIDIT_THINKER", "hf")
# vLLM's legacy KV-cache variable, set as a user might have it: the engines' own kv_cache_gb must win
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# dtype="auto" (the CLI default) caches its per-machine measurement: a fresh cache per session, so
# no test depends on what an earlier run (or the user) left in ~/.cache/omnidit
import tempfile  # noqa: E402

os.environ.setdefault("OMNIDIT_CACHE_DIR", tempfile.mkdtemp(prefix="omnidit-cache-"))
# inductor's caches too, set before torch is imported (importing torch fills in its default, which
# `omnidit serve` cannot tell from "unset"): every session compiles from cold as a fresh CI machine does
# (not from what earlier runs left in /tmp/torchinductor_$USER), and test_warm_start's servers can be
# handed this session's directory
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.environ["OMNIDIT_CACHE_DIR"], "inductor"))

import pytest  # noqa: E402
import torch  # noqa: E402

from dit_core import Engine  # noqa: E402
from dit_core.random_models import build  # noqa: E402
from tests import lanes  # noqa: E402
# the playground's browser and server, shared by the page tests of several modules
from tests.playground_fixtures import playground_browser, playground_server  # noqa: E402, F401

FAMILIES = ("flux", "sd3", "qwenimage")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> path of its tiny random checkpoint, built once per session."""
    root = tmp_path_factory.mktemp("models")
    return {f: build(f, "tiny", root / f) for f in FAMILIES}


# variants of the tiny checkpoints: name -> (family, random_models size)
VARIANTS = {"sd3.5": ("sd3", "tiny-3.5"), "qwenimage-vl": ("qwenimage", "tiny-vl")}


@pytest.fixture(scope="session")
def variant_models(tmp_path_factory):
    """name -> path of a variant checkpoint (SD3.5 dual attention + qk-norm; Qwen-Image with the
    Qwen2.5-VL text encoder), each built on first use."""
    root = tmp_path_factory.mktemp("variants")
    built = {}

    def get(name: str):
        if name not in built:
            family, size = VARIANTS[name]
            built[name] = build(family, size, root / name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def engines(tiny_models):
    """family -> a shared fp32 Engine. Tests must leave it idle (every request finished)."""
    cache = {}

    def get(family: str) -> Engine:
        if family not in cache:
            cache[family] = Engine.from_pretrained(tiny_models[family], max_batch_size=8)
        assert not cache[family].has_unfinished()
        return cache[family]

    return get


@pytest.fixture(scope="session")
def compiled_flux(tiny_models):
    """The tiny FLUX compiled (fp32, blocks warmed for 32x32), one per session: test_compile's engine, and
    the inductor cache test_warm_start's servers start from (compiling again costs a minute on 2 cores)."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    engine = Engine.from_pretrained(tiny_models["flux"], compile=True, compile_warmup="32x32")
    engine.warmup_graphs = counters["stats"]["unique_graphs"] - before  # the first compile of these classes
    return engine


def pytest_collection_modifyitems(config, items):
    """Under `make test`'s two xdist workers: the heaviest groups of modules first (tests/lanes.py)."""
    if hasattr(config, "workerinput"):
        lanes.order(items)


def pytest_xdist_make_scheduler(config, log):
    """`make test`'s xdist scheduler: each group of modules runs whole on one worker (tests/lanes.py)."""
    return lanes.make_scheduler(config, log)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def wan_tiny(tmp_path_factory):
    """The tiny random Wan 2.1 checkpoint (VAE factors 8 spatial, 4 temporal: 4k + 1 frames)."""
    return build("wan", "tiny", tmp_path_factory.mktemp("models") / "wan")


@pytest.fixture(scope="session")
def tiny_audio(tmp_path_factory):
    """The tiny random Stable Audio checkpoint (8 kHz stereo, at most 0.128 s), built once per session."""
    return build("stable-audio", "tiny", tmp_path_factory.mktemp("models") / "stable-audio")


@pytest.fixture(scope="session")
def reliability_server(tmp_path_factory):
    """A live server with one tiny model of every HTTP kind (img, vid, sound, tts) and small bounds
    (benchmarks.live), shared by the fuzz, fault-injection and security tests. Tests disarm what they arm."""
    from benchmarks.live import build_models, live_server, reliability_settings

    models = build_models(tmp_path_factory.mktemp("reliability"))
    with live_server(models, reliability_settings(max_inflight_per_client=6, max_queue=256)) as live:
        yield live
