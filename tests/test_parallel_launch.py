"""dit_core/parallel at start and at the end: invalid plans fail naming the flag and the constraint,
a worker that dies fails its requests and shows on /health, the CLI's flags, no process left behind."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from dit_core import AsyncEngine, Engine, EngineDeadError, InvalidParamError
from helpers import CFG, params
from procs import alive, descendants
from serve.app import create_app
from serve.cli import main as cli_main
from serve.server import free_port


@pytest.fixture(scope="module", autouse=True)
def parallel_server(tiny_models):
    """The ``omnidit serve --ulysses 2`` of the SIGTERM test, started with the module: its start (two processes
    importing torch and diffusers one after the other, ~20 s of one core) overlaps the tests before it, which
    mostly wait on their own workers' imports. Tests that count this process's descendants leave its tree out
    (``own_descendants``)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "serve.cli", "serve", str(tiny_models["flux"]),
                               "--port", str(port), "--ulysses", "2", "--ring", "1", "--row-parallel", "1",
                               "--dtype", "float32"])  # no dtype measurement: not what the test is about
    server.url = f"http://127.0.0.1:{port}"
    try:
        yield server
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def own_descendants(server) -> set[int]:
    """This process's live descendants, less the module's server and whatever it started."""
    return descendants(os.getpid()) - descendants(server.pid) - {server.pid}


# ---- invalid plans fail at start, naming the flag and the constraint ----


def test_heads_not_divisible_by_ulysses(tiny_models):
    with pytest.raises(InvalidParamError, match="divisor of the 2 attention heads") as e:
        Engine.from_pretrained(tiny_models["flux"], ulysses=4)
    assert "ulysses" in e.value.field and "--ulysses" in e.value.field


def test_sequence_shorter_than_the_ring(tiny_models, tmp_path):
    small = shutil.copytree(tiny_models["flux"], tmp_path / "flux")
    index = json.loads((small / "model_index.json").read_text())
    index["_omnidit_defaults"] = {"height": 4, "width": 4}  # one image token
    (small / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidParamError, match="at least as long as ulysses x ring = 2") as e:
        Engine.from_pretrained(small, ring=2)
    assert "--ring" in e.value.field


def test_world_size_must_equal_the_product(tiny_models):
    with pytest.raises(InvalidParamError, match=r"row_parallel x ring x ulysses = 1 x 1 x 2 = 2") as e:
        Engine.from_pretrained(tiny_models["flux"], ulysses=2, world_size=4)
    assert "--world-size" in e.value.field


def test_ring_needs_an_attention_backend_with_log_sum_exps(tiny_models):
    with pytest.raises(InvalidParamError, match="log-sum-exps") as e:
        Engine.from_pretrained(tiny_models["flux"], ring=2, attention="flex")
    assert "--ring" in e.value.field


def test_cli_names_the_flag(tiny_models, capsys):
    assert cli_main(["generate", "a cat", "-m", str(tiny_models["flux"]), "--ulysses", "4"]) == 2
    assert "--ulysses" in capsys.readouterr().err
    assert cli_main(["generate", "a cat", "-m", str(tiny_models["flux"]), "--ulysses", "0"]) == 2
    assert "an integer >= 1" in capsys.readouterr().err


# ---- a worker that fails or dies; shutdown ----


def test_a_worker_failing_at_start_is_reported_and_nothing_is_left(tiny_models, tmp_path, parallel_server):
    from dit_core import EngineConfig, ParallelWorkerError
    from dit_core.families import load_family

    family = load_family(tiny_models["flux"], torch.float32, torch.device("cpu"))
    family.model_id = str(tmp_path)  # workers load from here: an empty folder
    before = own_descendants(parallel_server)
    with pytest.raises(ParallelWorkerError, match=r"parallel worker rank 1 \(pid \d+\) failed: UnknownModelError"):
        Engine(family, EngineConfig(ulysses=2))
    assert own_descendants(parallel_server) <= before


def test_killed_worker_fails_its_requests_and_health_reports_it(tiny_models, tmp_path):
    """(and LoRA loads: one a worker refuses fails naming the rank, the group still up; after the kill a
    load fails naming the dead rank, the adapter set unchanged)"""
    from dit_core import ParallelWorkerError
    from dit_core.adapters import AdapterError
    from dit_core.adapters.files import Adapter, LoraWeights
    from test_lora import kohya_file

    engine = Engine.from_pretrained(tiny_models["flux"], ulysses=2, max_loras=2)
    pids = engine.parallel.pids
    worker = pids[0]
    lora = kohya_file(tmp_path / "k.safetensors", seed=1)
    # what a worker cannot take (here a layer its transformer lacks; on a GPU, no room for the factors)
    odd = Adapter("odd", "odd.safetensors",
                  {"no_such.linear": LoraWeights(torch.zeros(2, 32), torch.zeros(32, 2), 1.0)})
    with pytest.raises(AdapterError, match=rf"adapter 'odd' could not be loaded on parallel rank 1 \(pid {worker}\): "
                                           r"ValueError: this rank's transformer has no linear layer no_such\.linear"):
        engine.parallel.load_adapter(engine.default_model, odd)
    engine.load_lora("k", lora)  # the group is still up
    assert [d["name"] for d in engine.loras()] == ["k"]
    ids = [engine.add_request("a cat", params(num_inference_steps=40, seed=1, loras=[("k", 0.5)])),
           engine.add_request("a dog", params(num_inference_steps=40, seed=2, **CFG["flux"]))]
    for _ in range(2):
        engine.step()
    os.kill(worker, signal.SIGKILL)
    started = time.monotonic()
    events = engine.step()
    assert time.monotonic() - started < 30  # failed, not hung
    failed = {ev.request_id: ev.error for ev in events if ev.kind.final}
    assert set(failed) == set(ids)
    for error in failed.values():
        assert f"parallel worker rank 1 (pid {worker}) died (killed by SIGKILL)" in error
    assert "died" in engine.health()
    with pytest.raises(ParallelWorkerError, match=rf"parallel worker rank 1 \(pid {worker}\) died"):
        engine.load_lora("late", lora)
    assert [d["name"] for d in engine.loras()] == ["k"]
    async_engine = AsyncEngine(engine)
    client = TestClient(create_app(async_engine))
    response = client.get("/health")
    assert response.status_code == 503 and "killed by SIGKILL" in response.json()["error"]["message"]
    with pytest.raises(EngineDeadError, match="died"):
        engine.make_request("a cat", params())
    async_engine.shutdown()
    assert not [p for p in pids if alive(p)]


def test_cli_generate_with_parallel_flags_matches_and_leaves_no_process(tiny_models, tmp_path, monkeypatch,
                                                                        parallel_server):
    # ranks started as their own processes, as on CUDA (a CPU engine forks them from one launcher)
    monkeypatch.setenv("OMNIDIT_PARALLEL_START", "exec")
    # float32 pinned: under the default --dtype auto each run measures its own kernels (oneDNN linears
    # alone, aten ones with a parallel degree) and may pick another dtype: CI once saw the two images 7
    # levels apart, as far as a bf16 and an fp32 run are
    base = ["generate", "a cat", "-m", str(tiny_models["flux"]), "--steps", "3", "--size", "32x32", "--seed", "5",
            "--dtype", "float32"]
    assert cli_main(base + ["-o", str(tmp_path / "one.png")]) == 0
    before = own_descendants(parallel_server)
    assert cli_main(base + ["-o", str(tmp_path / "two.png"), "--ulysses", "2", "--ring", "1",
                            "--row-parallel", "1"]) == 0
    assert own_descendants(parallel_server) <= before  # the workers and their launcher are gone
    from PIL import Image

    one, two = (torch.from_numpy(np.asarray(Image.open(tmp_path / n), dtype=np.int16)) for n in ("one.png", "two.png"))
    assert (one - two).abs().max().item() <= 1  # 8-bit rounding of images within 1e-5


def test_serve_with_parallel_flags_then_sigterm_leaves_no_process(parallel_server):
    import httpx
    import openai

    server, url = parallel_server, parallel_server.url
    deadline = time.monotonic() + 300
    while True:
        assert server.poll() is None and time.monotonic() < deadline, "server did not start"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        time.sleep(0.5)
    workers = descendants(server.pid)
    assert len(workers) >= 2  # the launcher and rank 1
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    image = client.images.generate(model="flux", prompt="a cat", size="32x32", response_format="b64_json",
                                   extra_body={"num_inference_steps": 2, "seed": 3})
    assert image.data[0].b64_json
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0
    assert not [p for p in workers if alive(p)]
