"""Named fault-injection points, for tests: every engine has a ``Faults`` with nothing armed.

A test arms a point for requests whose prompt contains a trigger; the code at that point then raises
for those requests only, and the test checks that only they fail::

    engine.faults.arm("decode", prompt="boom")
    ...
    engine.faults.disarm()

Points (where the check sits):

* ``encode``: admission, before the family encodes the prompts (dit_core/runner.py)
* ``thinker``: inside an AR thinker's prompt encoding (families with a thinker, e.g. Qwen-Image)
* ``forward``: the batched transformer forward (runner)
* ``sampler_step``: one request's guidance + sampler step (runner)
* ``decode``: the VAE decode of finished requests (runner)
* ``output_encoding``: the server's PNG / MP4 / audio encoding of a finished request (serve/routes)
* ``file_store``: storing a result (the url file store; the video job store's disk write, which fails
  like a full disk: ``OSError(ENOSPC)``)

An unarmed point costs one dict lookup. Nothing arms a point outside tests: there is no flag or
environment variable for it.
"""

from __future__ import annotations

import errno
import threading

POINTS = ("encode", "thinker", "forward", "sampler_step", "decode", "output_encoding", "file_store")


class InjectedFault(RuntimeError):
    """The error an armed point raises (unless the test gave another)."""


class Faults:
    """The armed points of one engine: point -> (trigger substring, error factory)."""

    def __init__(self):
        self._armed: dict[str, tuple[str, object]] = {}
        self._lock = threading.Lock()
        self.hits: dict[str, int] = {}

    def arm(self, point: str, prompt: str = "boom", error=None) -> None:
        """Make ``point`` raise for requests whose prompt contains ``prompt``. ``error``: a callable
        returning the exception to raise (default ``InjectedFault("injected fault at POINT")``)."""
        if point not in POINTS:
            raise ValueError(f"unknown fault point {point!r}; points: {list(POINTS)}")
        with self._lock:
            self._armed[point] = (prompt, error or (lambda: InjectedFault(f"injected fault at {point}")))

    def disarm(self, point: str | None = None) -> None:
        with self._lock:
            if point is None:
                self._armed.clear()
            else:
                self._armed.pop(point, None)

    def hit(self, point: str, prompts) -> None:
        """Raise if ``point`` is armed and one of ``prompts`` (strings, or objects with ``.prompt``)
        carries its trigger."""
        armed = self._armed.get(point)
        if armed is None:
            return
        trigger, error = armed
        texts = [p if isinstance(p, str) else (getattr(p, "prompt", None) or "") for p in prompts]
        if any(trigger in t for t in texts):
            with self._lock:
                self.hits[point] = self.hits.get(point, 0) + 1
            raise error()


def disk_full(path: str = "/var/lib/omnidit/store") -> OSError:
    """What writing to a full disk raises (for the ``file_store`` point)."""
    return OSError(errno.ENOSPC, "No space left on device", path)


NO_FAULTS = Faults()  # what a family outside an engine checks: never armed
