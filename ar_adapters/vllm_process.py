"""What a supervisor needs to know about a vLLM engine whose core runs in a child process.

``vllm.LLM`` (V1) starts its EngineCore in a process of its own and talks to it over ZMQ. When that
process dies (killed, out of memory), vLLM's monitor thread marks the client dead and shuts it down,
but a caller already blocked waiting for the engine's next output is never woken: the thread that
fed the output queue just exits. ``wake`` puts vLLM's own ``EngineDeadError`` into that queue (and
into any utility call's pending answer) so such a caller raises instead of hanging.
"""

from __future__ import annotations

import logging
import signal

logger = logging.getLogger(__name__)


def _client(llm):
    return getattr(getattr(llm, "llm_engine", None), "engine_core", None)


def _processes(llm) -> list:
    resources = getattr(_client(llm), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def alive(llm) -> bool:
    """False once the engine core process has exited or the client has marked itself dead."""
    if llm is None:
        return False
    resources = getattr(_client(llm), "resources", None)
    if resources is not None and resources.engine_dead:
        return False
    return all(p.is_alive() for p in _processes(llm))  # an in-process engine core has none: alive


def exit_reason(llm) -> str:
    """How the engine core process ended, for messages: ``exit code -9 (SIGKILL)``."""
    codes = [p.exitcode for p in _processes(llm) if p.exitcode is not None]
    if not codes:
        return "the engine client reported it dead"
    code = codes[0]
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def wake(llm) -> None:
    """Make a caller blocked on the dead engine (its next output, or a utility call's answer) raise
    ``EngineDeadError``."""
    client = _client(llm)
    try:
        from vllm.v1.engine.exceptions import EngineDeadError

        queue = getattr(client, "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(EngineDeadError())
        for future in list((getattr(client, "utility_results", None) or {}).values()):
            if not future.done():
                future.set_exception(EngineDeadError())
    except Exception as e:  # noqa: BLE001 - best effort: the stage is being discarded anyway
        logger.debug("could not wake the dead engine's caller: %r", e)


def shutdown(llm) -> None:
    """Stop the engine client (and its process, if still there); safe on a dead engine."""
    client = _client(llm)
    if client is not None:
        client.shutdown()


class EngineProcess:
    """What ``ar_adapters.supervised`` asks of a vLLM stage (one holding an ``LLM`` as ``self.llm``):
    is its engine process alive, how did it end, and wake a caller blocked on it."""

    llm: object

    def alive(self) -> bool:
        return alive(self.llm)

    def exit_reason(self) -> str:
        return exit_reason(self.llm)

    def wake(self) -> None:
        wake(self.llm)
