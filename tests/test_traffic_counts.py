"""Every HTTP request is counted once by the server (serve/traffic.py), clients that leave included:
the soak benchmark's accounting rests on it. (The WebSocket session counter is tested beside the robot
socket's other tests, in test_openpi_socket.py.)"""

import threading
import time

import httpx
import pytest

from dit_core.faults import InjectedFault

ROUTE = "/v1/images/generations"


def counts(live) -> dict:
    """(method, route, status) -> count, and the handlers in flight, from the server's own metrics."""
    out = {}
    for metric in live.app.state.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "omnidit_http_responses_total":
                out[(s.labels["method"], s.labels["route"], s.labels["status"])] = int(s.value)
            elif s.name == "omnidit_http_in_flight":
                out["in_flight"] = int(s.value)
    return out


def new_counts(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if k != "in_flight" and after[k] != before.get(k, 0)}


def settled(live, before: dict, expected: int, timeout_s: float = 20) -> dict:
    """The counts once ``expected`` more requests have been counted and no handler runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = counts(live)
        done = sum(new_counts(before, after).values()) >= expected and after["in_flight"] == 0
        if done or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


@pytest.fixture
def held_admission(reliability_server):
    """Requests whose prompt contains "hold" wait at admission until the test lets them go (then fail)."""
    release = threading.Event()
    faults = reliability_server.engine.engine.faults

    def held():
        release.wait(30)
        return InjectedFault("released")

    faults.arm("encode", prompt="hold", error=held)
    yield release
    release.set()
    faults.disarm()


def test_a_client_that_gives_up_is_counted_once_as_499(reliability_server, held_admission):
    live = reliability_server
    body = {"prompt": "hold on", "model": "img", "size": "32x32", "num_inference_steps": 2}
    before = counts(live)
    with pytest.raises(httpx.ReadTimeout):  # the request went out whole; the client stops waiting
        httpx.post(f"{live.url}{ROUTE}", json=body, timeout=httpx.Timeout(30, read=0.3))
    after = settled(live, before, 1)
    # the handler saw the client leave and aborted the request: one count, 499, not the 503 it "sent"
    assert new_counts(before, after) == {("POST", ROUTE, "499"): 1}
    assert after["in_flight"] == 0
    held_admission.set()
    # an answered request is counted once with its status
    before = counts(live)
    r = httpx.post(f"{live.url}{ROUTE}", json={**body, "prompt": "a cat"}, timeout=60)
    assert r.status_code == 200
    assert new_counts(before, settled(live, before, 1)) == {("POST", ROUTE, "200"): 1}


def test_a_stream_cut_half_way_is_counted_once(reliability_server, held_admission):
    """An SSE stream the client drops once its headers came (the request held at admission, so the answer
    cannot have been finished): counted once, as 499, though its status line said 200."""
    live = reliability_server
    before = counts(live)
    body = {"prompt": "hold the stream", "model": "img", "size": "32x32", "num_inference_steps": 2, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{live.url}{ROUTE}", json=body) as r:
        assert r.status_code == 200  # the answer has started; leaving the block drops the connection
    after = settled(live, before, 1)
    assert new_counts(before, after) == {("POST", ROUTE, "499"): 1}
