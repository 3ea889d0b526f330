"""Supervised AR stages: a thinker or talker that outlives the death of its vLLM engine process.

``SupervisedThinker`` and ``SupervisedTalker`` wrap a stage built by a ``start`` factory (any
``Thinker``, any talker). A ``Supervisor`` watches it: a watcher thread asks the stage's ``alive()``
every ``poll_s`` seconds, and a call that raises on a dead stage is noticed too. When it died:

* the calls in flight raise ``StageDownError`` (a caller blocked on the dead engine is woken by the
  stage's ``wake()``), and so does every call until the stage is back: its message names the stage
  and says what is being done, its ``retry_after_s`` when to try again. The engine fails the requests
  concerned with it, per request, as temporary failures (the server answers 503 with Retry-After);
* ``health()`` says why the stage is down (``Engine.health()``; the server's ``/health`` answers
  503 ``engine_degraded`` with it);
* a background thread replaces the stage: ``on_failure="restart"`` runs ``start`` again (a new vLLM
  engine; up to ``attempts`` tries, backing off), ``"fallback"`` builds the ``fallback`` stage (the
  transformers implementation) instead. Later calls go to the new stage. ``outcomes`` counts how each
  replacement ended: ``restart``, ``fallback`` or ``failed`` (every attempt failed; the server's
  ``omnidit_stage_restarts_total``).

A stage needs ``close()``; ``alive()`` (default: alive), ``exit_reason()`` and ``wake()`` are
used when it has them (vLLM stages do: ar_adapters/vllm_process.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .contract import Encoded, TalkerEvent, Thinker, run_to_end

logger = logging.getLogger(__name__)
ON_FAILURE = ("restart", "fallback")


DEFAULT_RETRY_AFTER_S = 5.0  # the hint while a replacement of unknown build time is under way


class StageDownError(RuntimeError):
    """A supervised stage cannot serve this call: its engine process died (it is being replaced).
    ``retry_after_s``: seconds after which the stage may serve again (0: no replacement under way)."""

    def __init__(self, message: str, retry_after_s: float = DEFAULT_RETRY_AFTER_S):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def check_on_failure(on_failure: str) -> str:
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure={on_failure!r} is not one of {list(ON_FAILURE)}")
    return on_failure


def _alive(stage) -> bool:
    return getattr(stage, "alive", lambda: True)()


class Supervisor:
    """Owns one stage at a time (``stage``; None while it is being replaced) and replaces it when it dies.
    ``generation`` counts deaths: work a caller gave an earlier generation is lost."""

    def __init__(self, name: str, start: Callable[[], object], fallback: Callable[[], object] | None = None,
                 on_failure: str = "restart", attempts: int = 3, poll_s: float = 0.2, backoff_s: float = 1.0):
        self.name = name  # "the vLLM thinker": messages start with it
        self.on_failure = check_on_failure(on_failure)
        self._start, self._fallback = start, fallback
        self.attempts, self.poll_s, self.backoff_s = attempts, poll_s, backoff_s
        self.generation = 0
        self.restarts = 0  # replacements that came up (restarts and fallbacks)
        self.outcomes = {"restart": 0, "fallback": 0, "failed": 0}  # how each replacement ended
        self.build_s: dict[str, float] = {}  # "start" / "fallback" -> how long the last build took
        self._died_at = 0.0
        self._replacing = False  # a replacement is being built (or backing off between attempts)
        self.problem: str | None = None  # why the stage is down (None while it serves)
        self.death: str | None = None  # the last death, for the errors of the work it took with it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._recovery: threading.Thread | None = None
        began = time.monotonic()
        self.stage = start()
        self.build_s["start"] = time.monotonic() - began
        self.kind = getattr(self.stage, "kind", None)
        self._watcher = threading.Thread(target=self._watch, name="omnidit-stage-watch", daemon=True)
        self._watcher.start()

    # ---- for the wrappers ----

    def current(self) -> tuple[object, int]:
        """The serving stage and its generation, or StageDownError."""
        with self._lock:
            stage, generation = self.stage, self.generation
        if stage is None:
            raise StageDownError(self.problem or f"{self.name} is not running", self.retry_after_s())
        return stage, generation

    def check(self, stage, error: BaseException) -> None:
        """After a call on ``stage`` raised ``error``: return if the stage is fine (an ordinary error,
        for the caller to re-raise); if it died, start replacing it and raise StageDownError."""
        if self.stage is stage and _alive(stage):
            return
        self._died(stage)
        raise StageDownError(self.lost_work_message(), self.retry_after_s()) from error

    def lost_work_message(self) -> str:
        return f"{self.death or self.name + ' stopped'} while serving this request; {self._plan()}: retry it"

    def retry_after_s(self) -> float:
        """When a call may succeed again: the time the replacement's last build took, less the time since
        the death (at least 1 s; ``DEFAULT_RETRY_AFTER_S`` for a build never timed); 0 when no replacement
        is under way (all attempts failed, or the stage is closed)."""
        if self.stage is not None:
            return 1.0  # back already (a caller that lost work on the old one may retry at once)
        if not self._replacing or self._stop.is_set():
            return 0.0
        build = self.build_s.get("fallback" if self._falls_back() else "start")
        if build is None:
            return DEFAULT_RETRY_AFTER_S
        return max(1.0, build - (time.monotonic() - self._died_at))

    def health(self) -> str | None:
        """None while the stage serves; else why not."""
        return None if self.stage is not None else (self.problem or f"{self.name} is not running")

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            stage, self.stage = self.stage, None
            self.problem = f"{self.name} is closed"
        if stage is not None:
            stage.close()
        recovery = self._recovery
        # a replacement being built is closed as soon as it is up; a thread created but not started
        # yet (close() raced a death) sees the stop flag and returns on its own
        if recovery is not None and recovery.ident is not None:
            recovery.join(timeout=120)

    # ---- death and replacement ----

    def _falls_back(self) -> bool:
        return self.on_failure == "fallback" and self._fallback is not None

    def _plan(self) -> str:
        if self._falls_back():
            return "falling back to the transformers implementation"
        return "restarting it"

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            stage = self.stage
            if stage is not None and not _alive(stage):
                self._died(stage)

    def _died(self, stage) -> None:
        with self._lock:
            if self.stage is not stage or self._stop.is_set():
                return  # already being replaced (or closing)
            self.stage = None
            self.generation += 1
            self._died_at = time.monotonic()
            self._replacing = True
            reason = getattr(stage, "exit_reason", lambda: "it stopped")()
            self.death = f"{self.name}'s engine process died ({reason})"
            self.problem = f"{self.name} is down: its engine process died ({reason}); {self._plan()}"
            self._recovery = threading.Thread(target=self._recover, args=(stage,), name="omnidit-stage-restart",
                                              daemon=True)
        logger.error("%s", self.problem)
        getattr(stage, "wake", lambda: None)()  # before the replacement thread closes the dead stage
        self._recovery.start()

    def _recover(self, dead) -> None:
        try:
            dead.close()
        except Exception as e:  # noqa: BLE001 - a dead engine may not close cleanly; it is gone either way
            logger.warning("closing the dead %s: %r", self.name, e)
        fallback = self._falls_back()
        build = self._fallback if fallback else self._start
        for attempt in range(1, self.attempts + 1):
            if self._stop.is_set():
                return
            began = time.monotonic()
            try:
                stage = build()
            except Exception as e:  # noqa: BLE001 - reported by health(); tried again
                logger.warning("replacing %s, attempt %d of %d failed: %r", self.name, attempt, self.attempts, e)
                self.problem = (f"{self.name} is down: its engine process died and attempt {attempt} of "
                                f"{self.attempts} to replace it failed ({type(e).__name__})")
                self._stop.wait(self.backoff_s * 2 ** (attempt - 1))
                continue
            with self._lock:
                closing = self._stop.is_set()
                if not closing:
                    self.stage, self.problem, self._replacing = stage, None, False
                    self.kind = getattr(stage, "kind", self.kind)
                    self.restarts += 1
                    self.build_s["fallback" if fallback else "start"] = time.monotonic() - began
                    self.outcomes["fallback" if fallback else "restart"] += 1
            if closing:
                stage.close()
            else:
                logger.warning("%s is back: %s", self.name, "replaced by the transformers implementation" if fallback
                               else "restarted")
            return
        self.problem = (f"{self.name} is down: its engine process died and {self.attempts} attempts to replace it "
                        "failed; restart the server")
        self._replacing = False
        self.outcomes["failed"] += 1


class SupervisedThinker(Thinker):
    """A ``Thinker`` whose stage is replaced when its engine process dies (see the module docstring)."""

    def __init__(self, start: Callable[[], Thinker], fallback: Callable[[], Thinker] | None = None,
                 on_failure: str = "restart", name: str = "the vLLM thinker", **options):
        self.supervisor = Supervisor(name, start, fallback, on_failure, **options)
        first = self.supervisor.stage
        super().__init__(first.tokenizer, first.model_id, first.max_length)

    @property
    def kind(self) -> str:
        return self.supervisor.kind

    @property
    def stage(self) -> Thinker | None:
        return self.supervisor.stage

    def _encode(self, texts: list[str]) -> list[Encoded]:
        stage, _ = self.supervisor.current()
        try:
            return stage._encode(texts)  # checked (and counted) by our own encode()
        except Exception as e:
            self.supervisor.check(stage, e)
            raise

    def health(self) -> str | None:
        return self.supervisor.health()

    def close(self) -> None:
        self.supervisor.close()


class SupervisedTalker:
    """A talker (``add`` / ``step`` / ``abort``) whose stage is replaced when its engine process dies.
    Requests live on a stage that died are lost: the next ``step`` raises StageDownError for them
    (the speech service fails those utterances), and ``add`` raises while no stage serves."""

    def __init__(self, start: Callable[[], object], fallback: Callable[[], object] | None = None,
                 on_failure: str = "restart", name: str = "the vLLM talker", **options):
        self.supervisor = Supervisor(name, start, fallback, on_failure, **options)
        self.max_length = self.supervisor.stage.max_length
        self._live: dict[str, int] = {}  # request id -> the generation it was added to

    @property
    def kind(self) -> str:
        return self.supervisor.kind

    @property
    def stage(self):
        return self.supervisor.stage

    def add(self, request_id: str, prompt_ids: list[int], max_tokens: int = 256,
            stop_token_ids: list[int] | None = None) -> None:
        stage, generation = self.supervisor.current()
        try:
            stage.add(request_id, prompt_ids, max_tokens, stop_token_ids)
        except Exception as e:
            self.supervisor.check(stage, e)
            raise
        self._live[request_id] = generation

    def step(self) -> list[TalkerEvent]:
        """One step of the stage; StageDownError when live requests were lost with a dead stage."""
        stage, generation = self.supervisor.stage, self.supervisor.generation
        lost = [rid for rid, g in self._live.items() if g != generation or stage is None]
        if lost:
            for rid in lost:
                del self._live[rid]
            raise StageDownError(self.supervisor.lost_work_message())
        if stage is None:
            return []
        try:
            events = stage.step()
        except Exception as e:
            self.supervisor.check(stage, e)
            raise
        for ev in events:
            if ev.finished:
                self._live.pop(ev.request_id, None)
        return events

    def abort(self, request_id: str) -> None:
        generation = self._live.pop(request_id, None)
        stage = self.supervisor.stage
        if stage is not None and generation == self.supervisor.generation:
            stage.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def generate_all(self, prompts: list[list[int]], max_tokens: int = 256,
                     stop_token_ids: list[int] | None = None) -> list[list[int]]:
        """The whole token sequence of each prompt, in prompt order."""
        return run_to_end(self, prompts, max_tokens, stop_token_ids)

    def health(self) -> str | None:
        return self.supervisor.health()

    def close(self) -> None:
        self._live.clear()
        self.supervisor.close()
