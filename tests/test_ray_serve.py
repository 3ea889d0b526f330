"""serve/ray_app: `omnidit serve --replicas` on Ray Serve, end to end, on one Ray cluster for the module.

The cluster (tests/ray_cluster.py) is the CLI itself (``omnidit serve --replicas 1 --max-replicas 2 ...``
in a subprocess, the embedded digits model with its thinker as a shared stage, plus the tiny Stable Audio and Wan
checkpoints, the embedded TTS model and the embedded reaching policy for the audio, video, speech and
robot routes, batch-aware routing with a budget of 4 requests per forward), started together with
``omnidit serve`` of the same flags without Ray (the single-process reference of
test_replicas_run_the_engine_the_same_flags_give_in_one_process). The first test runs on its one
replica (a LoRA adapter loaded before scaling); then a fixture loads it until the autoscaler adds the second
replica; every later test runs against 2 replicas; the last stops it with SIGTERM and checks, by pid, that
no Ray process is left.
"""

import base64
import concurrent.futures
import dataclasses
import io
import json
import os
import re
import signal
import time

import httpx
import numpy as np
import openai
import psutil
import pytest
import soundfile as sf
import torch
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from dit_core import EngineConfig
from dit_core.video import decode_mp4
from dit_core.zoo import default_model, default_policy, tts_model
from dit_core.zoo.reach_env import ReachEnv
from serve import ray_flags
from serve.app import ServeSettings
from serve_helpers import assert_error, live_server, post_then_hang_up
from ray_cluster import (AUDIO, AUTH, BUDGET, KEY, OTHER_KEY, RAY_FLAGS, SERVE_PARSER, SPEECH, TRIM_S, VIDEO,
                        accepted, alive, audio_and_videos, descendants, lora_lists, output, png_pixels, post,
                        record_actors, replicas, robot_actions, routed, serve_flags, speech, stop, wait_for)
from ray_cluster import cluster, keys_file, one_process, scaled, servers  # noqa: F401  (the module's fixtures)


def test_a_lora_loaded_before_scaling_is_recorded_and_a_failed_one_is_not(cluster, keys_file):
    """Runs on the one replica, before ``scaled`` adds the second: "early" is loaded (and recorded for replicas
    added later: test_a_replica_added_later_holds_the_adapters_loaded_before_it); a file that fails is not."""
    _, url = cluster
    assert len(replicas(url)["engines"]) == 1
    (keys_file.parent / "loras" / "broken.safetensors").write_bytes(b"not a safetensors file")
    r = httpx.post(f"{url}/v1/loras", json={"name": "early", "path": "bold.safetensors", "model": "digits"},
                   headers=AUTH, timeout=300)
    assert r.status_code == 200 and len(r.json()["replicas"]) == 1, r.text
    broken = {"name": "broken", "path": "broken.safetensors", "model": "digits"}
    assert_error(httpx.post(f"{url}/v1/loras", json=broken, headers=AUTH, timeout=300), 400, "path",
                 "invalid_lora_file")


def test_autoscaling_adds_a_replica_under_load(scaled):
    assert scaled["before"] == 1 and scaled["after"] == 2
    assert scaled["statuses"] == [200] * 6


def test_same_images_as_the_single_process_server(scaled):
    url = scaled["url"]
    requests = [dict(prompt=p, size=s, seed=seed, num_inference_steps=6)
                for p, s, seed in [("digit 1", "32x32", 1), ("digit 2", "32x32", 2), ("digit 3", "48x48", 3),
                                   ("digit 4", "48x48", 4)]]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)

    def generate(c, r):
        extra = {k: r[k] for k in ("seed", "num_inference_steps")}
        return c.images.generate(prompt=r["prompt"], size=r["size"], response_format="b64_json", extra_body=extra)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        remote = list(pool.map(lambda r: generate(client, r).data[0].b64_json, requests))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each replica runs: same kernels, same sums
    try:
        with live_server(default_model(), ServeSettings(model_name="digits")) as srv:
            local_client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
            local = [generate(local_client, r).data[0].b64_json for r in requests]
    finally:
        torch.set_num_threads(threads)
    for r, a, b in zip(requests, remote, local):
        diff = np.abs(png_pixels(a) - png_pixels(b)).max()
        # A row's result does not depend on its batchmates within 1e-6 (fp32); after 8-bit quantization
        # that can flip one level at most.
        assert diff <= 1, (r, diff)
    assert sum(a == b for a, b in zip(remote, local)) >= 3  # and the PNGs are almost always byte-identical


def test_streaming_errors_models_and_api_key(scaled):
    url = scaled["url"]
    body = {"prompt": "digit 5", "num_inference_steps": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/images/generations", json=body, headers=AUTH, timeout=120) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    events = [json.loads(x) for x in lines[:-1]]
    assert lines[-1] == "[DONE]"
    assert [(e["step"], e["total"]) for e in events if e["type"] == "progress"][0] == (1, 4)
    assert [e["type"] for e in events].count("image") == 1
    # validated in a replica, answered like the single-process server
    assert_error(post(url, {"prompt": "x", "size": "30x32"}), 400, "size", "invalid_value")  # the field sent
    assert_error(post(url, {"prompt": "x", "colour": "red"}), 400, "colour")
    assert_error(post(url, {"prompt": "x", "model": "sdxl"}), 404, "model", "model_not_found")
    assert_error(httpx.post(f"{url}/v1/images/generations", json={"prompt": "x"}), 401, code="invalid_api_key")
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{url}/v1/models", headers=AUTH).json()
    assert [(m["id"], m["kind"]) for m in models["data"]] == [("digits", "image"), ("sound", "audio"),
                                                              ("clips", "video"), ("tts", "audio"),
                                                              ("reach", "actions")]
    detail = httpx.get(f"{url}/v1/models/digits", headers=AUTH).json()
    assert detail["details"]["defaults"]["height"] == 32


def test_a_replica_added_later_holds_the_adapters_loaded_before_it(scaled):
    """The replica the autoscaler added loaded "early" (POSTed when there was one replica) as it started, and
    nothing of the failed load; a request naming it gives the same image on either replica."""
    url = scaled["url"]
    ids = {e["replica"] for e in replicas(url)["engines"]}
    assert len(ids) == 2 and lora_lists(url) == {i: (["early"], []) for i in ids}
    body = {"prompt": "digit 3", "seed": 3, "num_inference_steps": 80, "response_format": "b64_json"}
    plain = png_pixels(post(url, body).json()["data"][0]["b64_json"])
    before = accepted(url)
    n = BUDGET + 2  # one replica's batch fills its budget, the rest go to the other
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda _: post(url, {**body, "lora": [{"name": "early", "scale": 1.0}]}), range(n)))
    assert [r.status_code for r in results] == [200] * n, [r.text for r in results]
    key = "digits|32x32x1"
    served = [keys.get(key, 0) - before.get(rid, {}).get(key, 0) for rid, keys in accepted(url).items()]
    assert sum(served) == n and min(served) > 0, served  # both replicas ran it
    images = [png_pixels(r.json()["data"][0]["b64_json"]) for r in results]
    # the same seed on either replica: equal, up to the one level a batch can flip (see the test above)
    assert max(np.abs(i - images[0]).max() for i in images) <= 1
    assert np.abs(images[0] - plain).max() > 1  # and the adapter did apply


def test_a_delete_one_replica_refuses_unloads_it_from_none(scaled):
    """A DELETE refused by the replica where a request holds the adapter (409 naming that replica) leaves it on
    every replica; once the request is gone the DELETE unloads it everywhere."""
    url = scaled["url"]
    ids = {e["replica"] for e in replicas(url)["engines"]}
    body = {"prompt": "digit 1", "size": "64x64", "num_inference_steps": 1000, "lora": [{"name": "early"}]}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a request that runs until its client leaves (3 s)
        running = pool.submit(post, url, body, timeout=httpx.Timeout(3.0, connect=10))

        def holders():
            per = httpx.get(f"{url}/v1/loras", headers=AUTH, timeout=60).json()["replicas"]
            return [x["replica"] for x in per if any(a["in_use"] for a in x["data"])]

        (holder,) = wait_for(holders, 3, "the request to hold the adapter", poll_s=0.1)
        err = assert_error(httpx.delete(f"{url}/v1/loras/early", params={"model": "digits"}, headers=AUTH, timeout=60),
                           409, "name", "lora_in_use")
        assert holder in err["message"] and "nothing was unloaded" in err["message"], err
        assert lora_lists(url) == {i: (["early"], []) for i in ids}
        try:
            running.result()
        except httpx.ReadTimeout:  # (the usual end: it would have run longer)
            pass
    # its client left: the request is aborted in its replica, which lets the adapter go (at its next step)
    def delete():
        r = httpx.delete(f"{url}/v1/loras/early", params={"model": "digits"}, headers=AUTH, timeout=60)
        return r if r.status_code != 409 else None

    r = wait_for(delete, 30, "the aborted request to let the adapter go")
    assert r.status_code == 200 and {x["replica"] for x in r.json()["replicas"] if x["unloaded"]} == ids, r.text
    assert lora_lists(url) == {i: ([], []) for i in ids}


def test_a_lora_load_reaches_every_replica_and_is_listed_per_replica(scaled):
    """POST /v1/loras is broadcast to the engine replicas and answered per replica; GET lists each replica's
    adapters; a request naming it runs on whichever replica takes it; a second load of the name is 409 on
    every replica; another key (not in --lora-admins) gets 403; DELETE unloads it everywhere."""
    url = scaled["url"]
    body = {"name": "bold", "path": "bold.safetensors", "model": "digits"}
    assert_error(httpx.post(f"{url}/v1/loras", json=body, headers={"Authorization": f"Bearer {OTHER_KEY}"},
                            timeout=60), 403, None, "admin_key_required")
    r = httpx.post(f"{url}/v1/loras", json=body, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    ids = {e["replica"] for e in replicas(url)["engines"]}
    assert len(ids) == 2 and {x["replica"] for x in r.json()["replicas"]} == ids and r.json()["rank"] == 8
    listing = httpx.get(f"{url}/v1/loras", headers=AUTH, timeout=60).json()
    assert [(a["name"], a["model"], a["replicas"]) for a in listing["data"]] == [("bold", "digits", 2)]
    assert {x["replica"]: [a["name"] for a in x["data"]] for x in listing["replicas"]} == {i: ["bold"] for i in ids}
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        out = client.images.generate(prompt="digit 3", model="digits", response_format="b64_json",
                                     extra_body={"seed": 3, "num_inference_steps": 4,
                                                 "lora": [{"name": "bold", "scale": 1.0}]})
        assert png_pixels(out.data[0].b64_json).shape[:2] == (32, 32)
        assert_error(httpx.post(f"{url}/v1/loras", json=body, headers=AUTH, timeout=300), 409, "name", "lora_exists")
        assert_error(post(url, {"prompt": "x", "lora": [{"name": "nope"}]}), 400, "lora", "invalid_value")
    finally:
        r = httpx.delete(f"{url}/v1/loras/bold", params={"model": "digits"}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and {x["replica"] for x in r.json()["replicas"] if x["unloaded"]} == ids
    assert httpx.get(f"{url}/v1/loras", headers=AUTH, timeout=60).json()["data"] == []


def test_audio_speech_and_videos_match_the_single_process_server(scaled, tiny_audio, wan_tiny, tmp_path):
    url = scaled["url"]
    remote = {**audio_and_videos(url, AUTH), **speech(url, AUTH)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each replica runs: same kernels, same sums
    try:
        with live_server({"sound": tiny_audio, "clips": wan_tiny, "tts": tts_model()},
                         ServeSettings(video_dir=str(tmp_path))) as srv:
            local = {**audio_and_videos(srv.url, {}), **speech(srv.url, {})}
    finally:
        torch.set_num_threads(threads)
    # one request at a time: each ran alone in its batch on both sides, with the same kernels (both engines
    # come from dit_core.engine.load_engine: oneDNN-packed linears in both), so the bytes are the same
    assert remote["audio"] == local["audio"] and remote["rate"] == local["rate"] == "8000"
    assert remote["job"] == local["job"] == "32x32"
    assert remote["sync_headers"] == local["sync_headers"] == {"x-num-frames": "5", "x-fps": "16", "x-seed": "4"}
    for name, shape in (("job_mp4", (5, 32, 32, 3)), ("sync_mp4", (5, 32, 48, 3))):
        frames = decode_mp4(remote[name])
        assert frames.shape == shape and np.array_equal(frames, decode_mp4(local[name])), name
        assert remote[name] == local[name], name
    # speech: the talker's tokens are the same; its DiT chunks join forwards as they become ready (timing),
    # and a row's result depends on its batchmates by < 1e-6, which 16-bit PCM can turn into one level
    for name in ("streamed", "whole"):
        (a, rate_a), (b, rate_b) = (sf.read(io.BytesIO(x[name]), dtype="int16") for x in (remote, local))
        assert rate_a == rate_b == 8000 and a.shape == b.shape and len(a) > 8000, name
        assert np.abs(a.astype(np.int32) - b).max() <= 1, name
    pcm = [np.frombuffer(b"".join(base64.b64decode(e["audio"]) for e in x["sse"][:-1]), "<i2").astype(np.int32)
           for x in (remote, local)]
    assert pcm[0].shape == pcm[1].shape and len(pcm[0]) > 8000 and np.abs(pcm[0] - pcm[1]).max() <= 1
    assert remote["sse"][-1] == local["sse"][-1] and remote["sse"][-1]["type"] == "speech.audio.done"
    assert remote["sse"][-1]["usage"]["input_tokens"] == 4
    assert remote["voices"] == local["voices"] and {v[0] for v in remote["voices"]} == {"adam", "eve"}


def test_audio_and_video_errors_and_deleting_a_running_job_on_replicas(scaled):
    url = scaled["url"]
    # validated in a replica, the field named as the single-process server names it
    assert_error(httpx.post(f"{url}/v1/audio/generate", json={**AUDIO, "seconds": 5.0}, headers=AUTH), 400,
                 "seconds", "invalid_value")
    assert_error(httpx.post(f"{url}/v1/audio/generate", json={"prompt": "x", "model": "clips"}, headers=AUTH),
                 400, "model", "wrong_model_kind")
    assert_error(httpx.post(f"{url}/v1/videos", json={"model": "clips", "prompt": "x", "size": "30x32"},
                            headers=AUTH), 400, "size")
    assert_error(httpx.post(f"{url}/v1/videos", json={"model": "digits", "prompt": "x"}, headers=AUTH), 400,
                 "model", "wrong_model_kind")
    job = httpx.post(f"{url}/v1/videos", json={"model": "clips", "prompt": "slow", "size": "32x32",
                                               "num_inference_steps": 1000, "max_sequence_length": 16},
                     headers=AUTH).json()
    wait_for(lambda: httpx.get(f"{url}/v1/videos/{job['id']}", headers=AUTH).json()["status"] == "in_progress",
             60, "the job to start")
    deleted = httpx.delete(f"{url}/v1/videos/{job['id']}", headers=AUTH).json()
    assert deleted["deleted"]
    wait_for(lambda: all(e["live"] == 0 for e in replicas(url)["engines"]), 30, "the job's request to be aborted")
    # speech: validated in the replica's talker service; a client that hangs up aborts the utterance there
    assert_error(httpx.post(f"{url}/v1/audio/speech", json={**SPEECH, "voice": "nova"}, headers=AUTH), 400, "voice")
    assert_error(httpx.post(f"{url}/v1/audio/speech", json={**SPEECH, "model": "sound"}, headers=AUTH), 400,
                 "model", "wrong_model_kind")
    forwards, aborts = {e["replica"]: e["forwards"] for e in replicas(url)["engines"]}, aborted(url)
    with httpx.stream("POST", f"{url}/v1/audio/speech", headers=AUTH, timeout=60,
                      json={**SPEECH, "input": " ".join(["7"] * 30), "response_format": "pcm"}) as r:
        assert r.status_code == 200
        next(r.iter_bytes())  # the first audio, then hang up
    settled = settled_forwards(url)
    time.sleep(1)
    assert forwards_now(url) == settled  # no chunk runs any more
    assert sum(settled.values()) > sum(forwards.values())  # (it did run some)
    assert aborted(url) > aborts  # the chunks not yet computed were aborted, not run to their end
    # a whole utterance (flac: its talker finishes before any chunk is submitted) whose client hangs up
    # while its chunks run: every chunk not yet computed leaves the replica's engine
    forwards = {e["replica"]: e["forwards"] for e in replicas(url)["engines"]}

    def chunks_run():
        return sum(e["forwards"] for e in replicas(url)["engines"]) > sum(forwards.values())

    post_then_hang_up(f"{url}/v1/audio/speech", {**SPEECH, "input": " ".join(["7"] * 30), "response_format": "flac",
                                                 "num_inference_steps": 1000}, chunks_run, headers=AUTH)
    settled = settled_forwards(url)
    time.sleep(1)
    assert forwards_now(url) == settled  # no chunk runs any more
    assert 0 < sum(settled.values()) - sum(forwards.values()) < 1000  # not even one chunk's 1000 steps


def settled_forwards(url) -> dict:
    """Each replica's forwards once no caller streams from it and its engine holds no request. An abort takes
    effect at the step boundary after the forward in flight, which a loaded 2-core machine can take over a
    second to reach (a CI run saw one such forward land 1-2 s after "live" dropped)."""
    wait_for(lambda: all(e["live"] == e["unfinished"] == 0 for e in replicas(url)["engines"]), 30,
             "the aborted requests to leave the engines")
    return forwards_now(url)


def forwards_now(url) -> dict:
    engines = replicas(url)["engines"]
    assert all(e["unfinished"] == 0 for e in engines), engines  # nothing was submitted after the abort
    return {e["replica"]: e["forwards"] for e in engines}


def aborted(url) -> float:
    """Requests aborted in every replica's engine (the merged /metrics)."""
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    return sum(float(v) for v in re.findall(r'^omnidit_requests_total\{outcome="aborted",replica="\w+"\} (\S+)',
                                            text, re.M))


def test_robot_socket_matches_the_single_process_server(scaled):
    meta, remote = robot_actions(scaled["url"], KEY)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with live_server({"reach": default_policy()}, ServeSettings()) as srv:
            local_meta, local = robot_actions(srv.url, None)
    finally:
        torch.set_num_threads(threads)
    assert meta == local_meta and meta["model"] == "reach" and meta["action_horizon"] == 16
    for a, b in zip(remote, local):
        assert a.shape == (16, 2) and a.dtype == np.float32 and np.array_equal(a, b)


def test_robot_socket_bounds_hold_in_the_ingress(cluster):
    """The robot socket's bounds are the ingress' (the same create_app and settings): the deadline floor
    (--robot-min-deadline-ms, default 10), one frame in flight per session, and --max-ws-frame-mb (4 MiB;
    Ray Serve's HTTP proxy lets frames through up to 16 MiB, so the app refuses this one itself)."""
    _, url = cluster
    policy = WebsocketClientPolicy(url.replace("http://", "ws://") + "/v1/realtime/robot/openpi?model=reach&"
                                   "deadline_ms=1", api_key=KEY)
    session = policy.get_server_metadata()["session"]
    assert session["deadline_ms"] == session["min_deadline_ms"] == 10.0
    observation, _ = ReachEnv().reset(seed=0)
    policy._ws.send(msgpack_numpy.packb({**observation, "num_inference_steps": 300}))
    policy._ws.send(msgpack_numpy.packb(observation))  # before the first is answered: refused, not queued
    busy = policy._ws.recv(timeout=60)
    assert isinstance(busy, str) and busy.startswith("busy: "), busy
    reply = msgpack_numpy.unpackb(policy._ws.recv(timeout=120))  # the first frame is still answered
    assert reply["actions"].shape == (16, 2) and reply["server_timing"]["deadline_ms"] == 10.0
    big = {**observation, "observation/image": np.zeros((1300, 1200, 3), np.uint8)}  # 4.68 MB
    with pytest.raises(RuntimeError, match=r"larger than the limit of 4194304 bytes \(--max-ws-frame-mb=4\)"):
        policy.infer(big)


def test_metrics_expose_one_series_per_replica(scaled):
    url = scaled["url"]
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    assert re.search(r"^omnidit_replicas 2\.0$", text, re.M)
    ids = {e["replica"] for e in replicas(url)["engines"]}
    counted = set(re.findall(r'^omnidit_batch_size_count\{replica="(\w+)"\} ', text, re.M))
    assert counted == ids
    finished = re.findall(r'^omnidit_requests_total\{outcome="finished",replica="\w+"\} (\S+)', text, re.M)
    assert sum(float(v) for v in finished) >= 6
    assert re.search(r'^omnidit_errors_total\{kind="invalid_api_key"\} ', text, re.M)  # counted at the ingress
    # the playground's engine panel: every replica's numbers merged, and each replica's own
    stats = httpx.get(f"{url}/v1/engine/stats", headers=AUTH).json()
    assert {"queue", "steps", "step_cache", "prompt_cache", "requests"} < set(stats)
    assert {r["replica"] for r in stats["replicas"]} == ids
    assert stats["steps"]["total"] == sum(r["steps"]["total"] for r in stats["replicas"]) > 0
    assert stats["requests"]["finished"] == sum(r["requests"]["finished"] for r in stats["replicas"]) >= 6


def test_batch_aware_routing_keeps_a_key_together_then_spreads(scaled):
    url = scaled["url"]
    together = routed(url, "40x40", BUDGET - 1)
    assert sorted(together.values()) == [0, BUDGET - 1], together  # all on one replica: one batch
    spread = routed(url, "56x56", BUDGET + 2)
    assert sorted(spread.values()) == [2, BUDGET], spread  # the batch filled its budget, the rest went on


def test_the_thinker_runs_once_as_a_shared_stage(scaled):
    stats = replicas(scaled["url"])
    assert all(e["thinkers"] == {"digits": "remote"} and e["lm_parameters"] == 0 for e in stats["engines"])
    (stage,) = stats["thinkers"]["digits"]
    assert stage["kind"] == "hf" and stage["calls"] >= 1
    assert stage["cache"]["hits"] >= 1  # a prompt encoded for one replica served another from the cache


def test_client_disconnect_aborts_the_request_in_its_replica(scaled):
    url = scaled["url"]
    forwards = {e["replica"]: e["forwards"] for e in replicas(url)["engines"]}
    with pytest.raises(httpx.ReadTimeout):
        post(url, {"prompt": "slow", "num_inference_steps": 1000}, timeout=httpx.Timeout(2.0, connect=10))
    wait_for(lambda: all(e["live"] == 0 for e in replicas(url)["engines"]), 30, "the request to be aborted")
    ran = sum(e["forwards"] - forwards.get(e["replica"], 0) for e in replicas(url)["engines"])
    assert ran < 1000  # it stopped well before its 1000 steps


def test_replicas_run_the_engine_the_same_flags_give_in_one_process(scaled, one_process, tiny_audio, wan_tiny,
                                                                   keys_file):
    """Every EngineConfig field, as each replica's engine runs it (``config`` of /v1/engine/stats), equals
    what ``omnidit serve`` with the same flags but no Ray builds in one process; and the server flags that
    act on the engine's process or on the requests reach the replicas (--malloc-trim-interval,
    --max-pixel-steps on images). And that single-process server never imports Ray, from start to stop."""
    url = scaled["url"]
    flags = serve_flags({"sound": tiny_audio, "clips": wan_tiny}, keys_file)
    kinds = {f: ray_flags.REACH[SERVE_PARSER._option_string_actions[f].dest].kind
             for f in RAY_FLAGS + flags if f.startswith("--")}
    # the one process gets every flag of the cluster but those that only lay out Ray Serve
    assert {f for f, kind in kinds.items() if kind == "scale_out"} == {f for f in RAY_FLAGS if f.startswith("--")}
    too_large = {"prompt": "x", "size": "512x512", "num_inference_steps": 1000}
    proc, local_url, out = one_process  # (started with the cluster)
    assert proc.args[proc.args.index("serve") + 1:-2] == flags
    local = httpx.get(f"{local_url}/v1/engine/stats", headers=AUTH, timeout=30).json()["config"]
    local_error = assert_error(post(local_url, too_large, timeout=60), 400, "num_inference_steps", "request_too_large")
    # stopped, it exits cleanly, and it imported no Ray module at any point of its life
    assert stop(proc) == 0, output(out)[-3000:]
    assert "ray modules imported: []" in output(out).splitlines(), output(out)[-3000:]
    stats = httpx.get(f"{url}/v1/engine/stats", headers=AUTH, timeout=30).json()
    assert set(local) == {f.name for f in dataclasses.fields(EngineConfig)} | {"dtype_auto"}
    assert local["cpu_linear"]["digits"] == "onednn" and local["cpu_allocator"] == "reuse"  # what auto chose here
    (stage,) = replicas(url)["thinkers"]["digits"]
    assert len(stats["replicas"]) == 2
    for replica in stats["replicas"]:
        for field, value in local.items():
            if field == "thinker":  # --shared-thinker: the replicas call the stage, which runs what one process runs
                assert replica["config"][field] == {**value, "digits": "remote"} and stage["kind"] == value["digits"]
            else:
                assert replica["config"][field] == value, (field, replica["replica"])
    assert stats["config"] == stats["replicas"][0]["config"]  # (they agree: one merged section)
    # the pixel-step bound, resolved by a replica: the same answer as the single process gives
    remote_error = assert_error(post(url, too_large, timeout=60), 400, "num_inference_steps", "request_too_large")
    assert remote_error["message"] == local_error["message"]
    for engine in replicas(url)["engines"]:  # the process-memory settings act in each replica's own process
        assert engine["memory"]["malloc_trim_s"] == TRIM_S and engine["memory"]["gc_frozen"], engine["memory"]


def test_killing_a_replica_fails_its_requests_clearly_and_the_survivor_serves(scaled, keys_file):
    """And the LoRA record survives its own actor: killed, Ray Serve restarts it, it reloads its file, and
    the engine replica Ray Serve restarts loads the adapter POSTed before either died."""
    url = scaled["url"]
    r = httpx.post(f"{url}/v1/loras", json={"name": "kept", "path": "bold.safetensors", "model": "digits"},
                   headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    (record,) = record_actors(scaled["proc"])
    record.kill()
    wait_for(lambda: [p for p in record_actors(scaled["proc"]) if p.pid != record.pid], 120,
             "Ray Serve to restart the LoRA record")
    body = {"prompt": "digit 9", "num_inference_steps": 1000}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        inflight = [pool.submit(post, url, {**body, "seed": i}) for i in range(2)]
        busy = wait_for(lambda: [e for e in replicas(url)["engines"] if e["live"] == 2], 60, "the requests to start")
        victim = busy[0]
        os.kill(victim["pid"], signal.SIGKILL)
        for f in inflight:
            err = assert_error(f.result(), 503, code="engine_unavailable")
            assert f"engine replica {victim['replica']} died while serving request" in err["message"]
    after = post(url, {"prompt": "digit 0", "num_inference_steps": 3, "seed": 1})
    assert after.status_code == 200, after.text
    restarted = wait_for(lambda: [e for e in replicas(url)["engines"] if e["pid"] != victim["pid"]]
                         if len(replicas(url)["engines"]) == 2 else None, 300, "Ray Serve to restart the replica")
    assert victim["pid"] not in {e["pid"] for e in restarted} and not psutil.pid_exists(victim["pid"])
    assert lora_lists(url) == {e["replica"]: (["kept"], []) for e in restarted}
    r = httpx.delete(f"{url}/v1/loras/kept", params={"model": "digits"}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and all(x["unloaded"] for x in r.json()["replicas"]), r.text
    (state,) = (keys_file.parent / "loras" / ".omnidit").glob("lora-record-*.json")  # the restarted record's
    assert json.loads(state.read_text()) == {"entries": []}


def test_keys_own_their_jobs_and_files_in_the_ingress(cluster):
    """--api-key and --api-keys-file reach the ingress (their union), which owns what each key creates:
    the other key gets 404 for KEY's video job and url image, and does not list the job."""
    _, url = cluster
    a, b = (openai.OpenAI(base_url=f"{url}/v1", api_key=k, max_retries=0) for k in (KEY, OTHER_KEY))
    video = a.videos.create_and_poll(model="clips", prompt="waves", size="32x32", extra_body=VIDEO,
                                     poll_interval_ms=100)
    assert video.status == "completed", video.error
    image = a.images.generate(model="digits", prompt="digit 2", size="32x32", response_format="url",
                              extra_body={"num_inference_steps": 2})
    file_url = image.data[0].url
    for call in (b.videos.retrieve, b.videos.download_content, b.videos.delete):
        with pytest.raises(openai.NotFoundError):
            call(video.id)
    assert video.id not in [v.id for v in b.videos.list(limit=100).data]
    assert_error(httpx.get(file_url, headers={"Authorization": f"Bearer {OTHER_KEY}"}), 404, code="file_not_found")
    assert a.videos.retrieve(video.id).status == "completed"  # still there: B's delete deleted nothing
    assert video.id in [v.id for v in a.videos.list(limit=100).data]
    assert httpx.get(file_url, headers=AUTH).content.startswith(b"\x89PNG")
    assert a.videos.delete(video.id).deleted


def test_sigterm_stops_everything_and_leaves_no_ray_process(scaled):
    proc = scaled["proc"]
    ray_procs = descendants(proc.pid)
    pids = {p.pid for p in ray_procs}
    assert {e["pid"] for e in replicas(scaled["url"])["engines"]} <= pids  # the replicas are among them
    assert len(pids) >= 5  # GCS, raylet, Serve controller, proxy, ingress, engines, thinker, ...
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    wait_for(lambda: not alive(ray_procs), 30, f"Ray processes {[p.pid for p in alive(ray_procs)]} to exit")
