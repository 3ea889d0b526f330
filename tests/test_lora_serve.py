"""LoRA adapters over HTTP (serve/routes/loras.py, serve/loras.py) and on the command line: GET / POST
/v1/loras and DELETE /v1/loras/{name}, the ``lora`` field of image and video requests, ``--lora-dir``
confinement (symlinks included), the admin-key rule, loads while requests run, and ``omnidit generate
--lora``. One server for the module: the tiny FLUX ("flux") and the tiny Wan ("clips") in one engine,
4 adapter slots of rank 8 at most. (Parity of the adapters with diffusers: tests/test_lora.py.)"""

import asyncio
import base64
import io
import json
import os
import shutil
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from dit_core import Engine, SamplingParams
from dit_core.adapters import AdapterInUseError
from dit_core.video import as_uint8, encode_mp4
from serve.app import ServeSettings, create_app
from serve.cli import main as cli_main
from serve_helpers import assert_error, live_server, serve_app
from test_lora import TARGETS_A, TARGETS_B, bad_files, make_family_lora, make_lora

PROMPT = "a photo of a cat"
IMAGE = dict(size="32x32", response_format="b64_json")
EXTRA = {"seed": 7, "num_inference_steps": 3, "guidance_scale": 3.5}
STEPS = 200  # the running request of the load-while-running test: long enough for the calls made meanwhile
ADMIN, ALICE, BOB = "admin-k3y", "alice-k3y", "bob-k3y"


@pytest.fixture(scope="module")
def lora_dir(tiny_models, wan_tiny, tmp_path_factory):
    """--lora-dir: adapters for the tiny FLUX (a, b, and a copy of b under other names) and the tiny Wan,
    the bad files of tests/test_lora.py under bad/, and a file outside the folder."""
    root = tmp_path_factory.mktemp("lora-dir")
    flux = tiny_models["flux"]
    files = {"a": make_lora(flux, root / "a", TARGETS_A, r=4, alpha=8, seed=1),
             "b": make_lora(flux, root / "b", TARGETS_B, r=2, alpha=3, seed=2)}
    make_family_lora(wan_tiny, root / "wan", ["to_q", "to_v", "to_out.0", "ffn.net.2", "proj_out"], r=4, alpha=8,
                     seed=3)
    (root / "bad").mkdir()
    bad = bad_files(root / "bad", files)
    outside = tmp_path_factory.mktemp("outside")
    shutil.copy(files["a"], outside / "a.safetensors")
    os.symlink(outside / "a.safetensors", root / "escape.safetensors")  # inside the folder, pointing out of it
    os.symlink(files["b"], root / "inside.safetensors")  # a symlink that stays inside: fine
    return {"root": root, "bad": bad, "outside": outside / "a.safetensors"}


@pytest.fixture(scope="module")
def server(tiny_models, wan_tiny, lora_dir):
    engine = Engine.from_models({"flux": tiny_models["flux"], "clips": wan_tiny}, max_loras=4, max_lora_rank=8,
                                max_batch_size=8)
    with live_server(engine, ServeSettings(lora_dir=str(lora_dir["root"]))) as srv:
        yield srv


def load(srv, name, path, model="flux", headers=None):
    return httpx.post(f"{srv.url}/v1/loras", json={"name": name, "path": path, "model": model}, headers=headers,
                      timeout=60)


def listed(srv, headers=None) -> dict:
    r = httpx.get(f"{srv.url}/v1/loras", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return {(a["model"], a["name"]): a for a in r.json()["data"]}


def unload(srv, name, model="flux", headers=None):
    return httpx.delete(f"{srv.url}/v1/loras/{name}", params={"model": model}, headers=headers, timeout=30)


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))), dtype=np.int16)


def generate(client, lora=None, **extra):
    body = {**EXTRA, **extra, **({"lora": lora} if lora is not None else {})}
    return pixels(client.images.generate(prompt=PROMPT, extra_body=body, **IMAGE).data[0].b64_json)


def engine_output(srv, loras, model="flux", **kw):
    """The engine's own output for the same request, through its Python API (the server's engine)."""
    params = SamplingParams(loras=loras, **{"height": 32, "width": 32, **kw})
    return asyncio.run(srv.engine.generate(PROMPT, params, model=model))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_load_list_use_and_unload(server, client):
    r = load(server, "a", "a/pytorch_lora_weights.safetensors")
    assert r.status_code == 200, r.text
    entry = r.json()
    assert entry["name"] == "a" and entry["model"] == "flux" and entry["rank"] == 4 and entry["in_use"] == 0
    assert entry["path"] == "a/pytorch_lora_weights.safetensors" and entry["layers"] > 10
    assert entry["bytes"] == sum(4 * 4 * (n.in_features + n.out_features) for n in _targets(server, "a"))
    assert listed(server)[("flux", "a")] == entry
    only = lambda model: httpx.get(f"{server.url}/v1/loras", params={"model": model}, timeout=30)  # noqa: E731
    assert only("flux").json()["data"] == [a for a in listed(server).values() if a["model"] == "flux"]
    assert only("clips").status_code == 200 and ("flux", "a") not in {(a["model"], a["name"])
                                                                        for a in only("clips").json()["data"]}
    assert_error(only("nope"), 404, "model", "model_not_found")
    try:
        plain = generate(client)
        adapted = generate(client, [{"name": "a", "scale": 0.7}])
        assert np.abs(adapted - plain).max() >= 2  # the adapter changes the picture
        ref = np.asarray(engine_output(server, (("a", 0.7),), seed=7, num_inference_steps=3,
                                       guidance_scale=3.5).images[0], dtype=np.int16)
        assert np.array_equal(adapted, ref)  # the HTTP field means SamplingParams.loras, nothing else
        zero = generate(client, [{"name": "a", "scale": 0}])
        assert np.array_equal(zero, plain)
    finally:
        r = unload(server, "a")
    assert r.status_code == 200 and r.json() == {"object": "lora.deleted", "name": "a", "model": "flux",
                                                  "deleted": True}
    assert ("flux", "a") not in listed(server)
    assert_error(unload(server, "a"), 404, "name", "lora_not_found")


def _targets(srv, name):
    """The layers an adapter touches, as the engine holds them (for its size in bytes: 4 bytes x r x (in + out))."""
    store = srv.engine.engine.models["flux"].adapters
    return [store.layers[m] for m in store.adapters[name].layers]


def test_a_request_naming_an_unknown_or_repeated_adapter_is_a_400_naming_lora(server, client):
    r = httpx.post(f"{server.url}/v1/images/generations", timeout=60,
                   json={"prompt": PROMPT, **EXTRA, "lora": [{"name": "nope", "scale": 1.0}]})
    err = assert_error(r, 400, "lora", "invalid_value")
    assert "nope" in err["message"] and "loaded" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        generate(client, [{"name": "nope"}])
    assert e.value.body["param"] == "lora"
    r = httpx.post(f"{server.url}/v1/images/generations", timeout=60,
                   json={"prompt": PROMPT, "lora": [{"name": "x"}, {"name": "x", "scale": 2}]})
    assert_error(r, 400, "lora")
    r = httpx.post(f"{server.url}/v1/images/generations", timeout=60,
                   json={"prompt": PROMPT, "lora": [{"name": "x", "scale": "high"}]})
    assert_error(r, 400, "lora.0.scale")
    r = httpx.post(f"{server.url}/v1/images/generations", timeout=60, json={"prompt": PROMPT, "lora": "x"})
    assert_error(r, 400, "lora")


CASES = ["shape", "arch", "rank", "truncated", "corrupt", "text-encoder", "missing"]


@pytest.mark.parametrize("case", CASES)
def test_bad_files_are_400s_naming_the_file_and_what_is_wrong(server, lora_dir, case):
    path, pattern = lora_dir["bad"][case]
    before = listed(server)
    rel = os.path.relpath(path, lora_dir["root"])
    err = assert_error(load(server, "new", rel), 400, "path", "invalid_lora_file")
    assert rel in err["message"], err  # named as the client named it (no server path)
    assert str(lora_dir["root"]) not in err["message"]
    import re

    assert re.search(pattern, err["message"]), (pattern, err["message"])
    assert listed(server) == before  # a failed load leaves the set unchanged


def test_paths_outside_the_lora_dir_and_names_already_loaded(server, lora_dir, tmp_path):
    before = listed(server)
    for path in ("../outside/a.safetensors", str(lora_dir["outside"]), "escape.safetensors",
                 "a/../../" + lora_dir["outside"].parent.name + "/a.safetensors"):
        err = assert_error(load(server, "x", path), 400, "path", "path_outside_lora_dir")
        assert str(lora_dir["outside"]) not in err["message"]
    assert listed(server) == before
    assert load(server, "in", "inside.safetensors").status_code == 200  # a symlink within the folder
    try:
        err = assert_error(load(server, "in", "a/pytorch_lora_weights.safetensors"), 409, "name", "lora_exists")
        assert "'in' is already loaded" in err["message"]
        assert listed(server)[("flux", "in")]["rank"] == 2  # still the first file
    finally:
        assert unload(server, "in").status_code == 200
    # the model: required when several take adapters; one that does not exist; bad bodies
    r = httpx.post(f"{server.url}/v1/loras", json={"name": "x", "path": "a/pytorch_lora_weights.safetensors"})
    assert_error(r, 400, "model", "model_required")
    assert_error(load(server, "x", "a/pytorch_lora_weights.safetensors", model="sdxl"), 404, "model")
    assert_error(load(server, "bad name", "a/pytorch_lora_weights.safetensors"), 400, "name")
    # a server without --lora-dir loads nothing over HTTP
    app = create_app(server.engine, ServeSettings(), owns_engine=False)
    with serve_app(app, log_level="warning") as url:
        r = httpx.post(f"{url}/v1/loras", json={"name": "x", "path": "a/pytorch_lora_weights.safetensors",
                                                "model": "flux"})
        assert_error(r, 400, "path", "lora_dir_not_set")
        # ... and holds none: a DELETE is a 404 naming the adapter, not a request for a model
        err = assert_error(httpx.delete(f"{url}/v1/loras/x"), 404, "name", "lora_not_found")
        assert "holds no LoRA adapters" in err["message"] and "--lora-dir" in err["message"]


def test_video_requests_take_the_lora_field(server):
    assert load(server, "wa", "wan/pytorch_lora_weights.safetensors", model="clips").status_code == 200
    body = {"prompt": PROMPT, "size": "32x32", "num_frames": 5, "num_inference_steps": 2, "seed": 3,
            "max_sequence_length": 16}
    try:
        plain = httpx.post(f"{server.url}/v1/videos/sync", json=body, timeout=120)
        adapted = httpx.post(f"{server.url}/v1/videos/sync", json={**body, "lora": [{"name": "wa", "scale": 0.8}]},
                             timeout=120)
        assert plain.status_code == adapted.status_code == 200, adapted.text
        assert plain.content != adapted.content
        out = engine_output(server, (("wa", 0.8),), model="clips", num_frames=5, num_inference_steps=2, seed=3,
                            max_sequence_length=16)
        assert encode_mp4(as_uint8(out.outputs[0]), fps=int(adapted.headers["X-Fps"])) == adapted.content
        # a form (what the openai client sends) carries the list as JSON text
        form = {k: str(v) for k, v in body.items()} | {"lora": json.dumps([{"name": "wa", "scale": 0.8}])}
        r = httpx.post(f"{server.url}/v1/videos/sync", data=form, timeout=120)
        assert r.status_code == 200 and r.content == adapted.content
        r = httpx.post(f"{server.url}/v1/videos/sync", json={**body, "lora": [{"name": "a"}]}, timeout=120)
        assert_error(r, 400, "lora")  # an adapter of another model
    finally:
        assert unload(server, "wa", model="clips").status_code == 200


def test_loads_and_unloads_while_a_request_runs(server, client):
    """A request holding adapter a runs (streamed, many steps) while adapters are loaded, evicted and
    unloaded: a is never evicted and cannot be unloaded (409), and the request's image is exactly what
    it is alone."""
    assert load(server, "a", "a/pytorch_lora_weights.safetensors").status_code == 200
    lora = [{"name": "a", "scale": 0.9}]
    request = {"seed": 11, "num_inference_steps": STEPS, "guidance_scale": 3.5}
    body = {"prompt": PROMPT, **IMAGE, **request, "lora": lora}
    try:
        with httpx.stream("POST", f"{server.url}/v1/images/generations", json={**body, "stream": True},
                          timeout=300) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["type"] == "progress"  # running now
            assert listed(server)[("flux", "a")]["in_use"] == 1
            for name in ("b", "c", "d"):  # fills the 4 slots
                assert load(server, name, "b/pytorch_lora_weights.safetensors").status_code == 200
            assert load(server, "e", "inside.safetensors").status_code == 200  # evicts b, never a
            err = assert_error(unload(server, "a"), 409, "name", "lora_in_use")
            assert "in use by 1" in err["message"]
            now = listed(server)
            assert {n for _, n in now} == {"a", "c", "d", "e"} and now[("flux", "a")]["in_use"] == 1
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
        assert events[-1]["type"] == "image", events[-1]
        during = pixels(events[-1]["b64_json"])
        assert listed(server)[("flux", "a")]["in_use"] == 0
        alone = generate(client, lora, **request)
        assert np.array_equal(during, alone)
    finally:
        for name in ("a", "c", "d", "e"):
            unload(server, name)
    assert listed(server) == {}


def test_unload_never_slips_between_a_requests_check_and_its_pin(tiny_models, lora_dir, monkeypatch):
    """The engine thread checks and pins a request's adapters under the store's lock: an unload from a
    server thread waits, then finds the adapter in use (without the lock it would unload it between the
    check and the pin, and the request's forward would find it gone)."""
    engine = Engine.from_pretrained(tiny_models["flux"], max_loras=2, max_lora_rank=8)
    store = engine.family.adapters
    engine.load_lora("a", lora_dir["root"] / "a" / "pytorch_lora_weights.safetensors")
    checking = threading.Event()
    check = store.check

    def slow_check(loras):
        check(loras)
        checking.set()
        time.sleep(0.3)  # the window an unload would slip into

    monkeypatch.setattr(store, "check", slow_check)
    pin = threading.Thread(target=store.pin, args=((("a", 1.0),),))
    pin.start()
    assert checking.wait(10)
    with pytest.raises(AdapterInUseError, match="in use by 1"):
        store.unload("a")
    pin.join()
    assert store.describe()[0]["in_use"] == 1


def test_an_adapter_unloaded_after_the_routes_check_is_a_400_naming_lora(server, monkeypatch):
    """DELETE /v1/loras/{name} lands after a request's check (make_request, in a worker thread) and before
    the engine thread admits and pins it: the request is a 400 naming lora (not a 500), holds nothing."""
    assert load(server, "gone", "a/pytorch_lora_weights.safetensors").status_code == 200
    engine = server.engine.engine
    make_request = engine.make_request

    def checked_then_unloaded(*args, **kw):
        req = make_request(*args, **kw)  # the adapter is resident: the check passes
        if req.params.loras:
            assert unload(server, "gone").status_code == 200  # (nothing holds it yet)
        return req

    monkeypatch.setattr(engine, "make_request", checked_then_unloaded)
    r = httpx.post(f"{server.url}/v1/images/generations", timeout=60,
                   json={"prompt": PROMPT, **EXTRA, "lora": [{"name": "gone"}]})
    err = assert_error(r, 400, "lora", "invalid_value")
    assert "gone" in err["message"] and "loaded" in err["message"]
    monkeypatch.undo()
    assert ("flux", "gone") not in listed(server)
    assert not engine.models["flux"].adapters.pins


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks the video API deprecated
def test_an_async_video_job_whose_adapter_was_unloaded_before_admission_fails_naming_lora(server, client,
                                                                                          monkeypatch):
    """The same race for POST /v1/videos: the job was accepted, so it fails, with the 400's code and message
    (``invalid_value``, naming ``lora``), not as a failed generation."""
    assert load(server, "wgone", "wan/pytorch_lora_weights.safetensors", model="clips").status_code == 200
    engine = server.engine.engine
    make_request = engine.make_request

    calls = []

    def checked_then_unloaded(*args, **kw):  # the route resolves the request, then submits it: unloaded
        req = make_request(*args, **kw)       # after the submit's own check, before the engine thread's pin
        calls.append(req.params.loras)
        if len(calls) == 2:
            assert unload(server, "wgone", model="clips").status_code == 200
        return req

    monkeypatch.setattr(engine, "make_request", checked_then_unloaded)
    job = client.videos.create_and_poll(model="clips", prompt=PROMPT, size="32x32", poll_interval_ms=50,
                                        extra_body={"num_frames": 5, "num_inference_steps": 2, "seed": 3,
                                                    "max_sequence_length": 16,  # a form: the list as JSON text
                                                    "lora": json.dumps([{"name": "wgone"}])})
    monkeypatch.undo()
    assert len(calls) == 2 and all(calls)
    assert job.status == "failed" and job.error.code == "invalid_value", job.error
    assert job.error.message.startswith("lora='wgone' is invalid") and "loaded" in job.error.message
    assert not engine.models["clips"].adapters.pins
    client.videos.delete(job.id)


def keyed(server, lora_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n")
    settings = ServeSettings(api_key=ADMIN, api_keys_file=str(keys), lora_dir=str(lora_dir["root"]),
                             lora_admins=("alice",))
    return create_app(server.engine, settings, owns_engine=False)


def test_only_admin_keys_load_and_unload(server, lora_dir, tmp_path):
    """Under API keys: the --api-key key and --lora-admins names load and unload; other keys get 403 and may
    still list adapters and use them."""
    with serve_app(keyed(server, lora_dir, tmp_path), log_level="warning") as url:
        srv = type("S", (), {"url": url})
        auth = {k: {"Authorization": f"Bearer {v}"} for k, v in (("admin", ADMIN), ("alice", ALICE), ("bob", BOB))}
        assert_error(load(srv, "a", "a/pytorch_lora_weights.safetensors", headers=auth["bob"]), 403, None,
                     "admin_key_required")
        assert_error(load(srv, "a", "a/pytorch_lora_weights.safetensors"), 401)
        assert load(srv, "a", "a/pytorch_lora_weights.safetensors", headers=auth["alice"]).status_code == 200
        try:
            assert listed(srv, auth["bob"])[("flux", "a")]["rank"] == 4
            bob = openai.OpenAI(base_url=f"{url}/v1", api_key=BOB, max_retries=0)
            assert generate(bob, [{"name": "a", "scale": 0.5}]).shape == (32, 32, 3)
            assert_error(unload(srv, "a", headers=auth["bob"]), 403, None, "admin_key_required")
        finally:
            assert unload(srv, "a", headers=auth["admin"]).status_code == 200


def test_generate_cli_applies_lora_files(server, tiny_models, lora_dir, tmp_path, capsys):
    """``omnidit generate --lora NAME=PATH:SCALE`` gives the server's image for the same request."""
    path = lora_dir["root"] / "a" / "pytorch_lora_weights.safetensors"
    out = tmp_path / "cli.png"
    argv = ["generate", str(tiny_models["flux"]), PROMPT, "-o", str(out), "--seed", "7", "--steps", "3",
            "--size", "32x32", "--guidance", "3.5", "--dtype", "float32", "--lora", f"a={path}:0.7"]
    assert cli_main(argv) == 0
    cli = np.asarray(Image.open(out), dtype=np.int16)
    assert load(server, "a", "a/pytorch_lora_weights.safetensors").status_code == 200
    try:
        ref = engine_output(server, (("a", 0.7),), seed=7, num_inference_steps=3, guidance_scale=3.5)
    finally:
        unload(server, "a")
    assert np.array_equal(cli, np.asarray(ref.images[0], dtype=np.int16))
    capsys.readouterr()
    assert cli_main(argv[:-1] + ["a"]) == 2  # no =PATH
    assert "--lora" in capsys.readouterr().err
    assert cli_main(argv[:-1] + [f"a={tmp_path / 'none.safetensors'}"]) == 2  # no such file: named by its flag
    err = capsys.readouterr().err
    assert "--lora a: " in err and "none.safetensors: no such file" in err, err


def test_image_edits_take_the_lora_field(server, client):
    """POST /v1/images/edits (a multipart form: the list as JSON text), through the openai client's images.edit:
    the adapter changes the edit, and the edit equals the engine's image-to-image with the same adapter."""
    pytest.importorskip("serve.routes.edits", reason="the image edit route (issue 37) has not landed yet")
    source = Image.fromarray(np.random.default_rng(5).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    png = io.BytesIO()
    source.save(png, format="PNG")
    steps = {"seed": 7, "num_inference_steps": 3, "strength": 0.8}

    def edit(lora=None):
        extra = {**steps, **({"lora": json.dumps(lora)} if lora is not None else {})}
        answer = client.images.edit(image=("cat.png", png.getvalue(), "image/png"), prompt=PROMPT, model="flux",
                                    size="32x32", response_format="b64_json", extra_body=extra)
        return pixels(answer.data[0].b64_json)

    assert load(server, "a", "a/pytorch_lora_weights.safetensors").status_code == 200
    try:
        adapted = edit([{"name": "a", "scale": 0.7}])
        assert np.abs(adapted - edit()).max() >= 2
        ref = engine_output(server, (("a", 0.7),), image=source, **steps)
        assert np.array_equal(adapted, np.asarray(ref.images[0], dtype=np.int16))
        with pytest.raises(openai.BadRequestError) as e:
            edit([{"name": "nope"}])
        assert e.value.body["param"] == "lora"
    finally:
        unload(server, "a")
