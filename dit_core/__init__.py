"""omnidit's engine: step-level continuous batching for diffusion transformers."""

from .config import EngineConfig
from .engine import Engine
from .errors import (
    BackendUnavailableError,
    EngineDeadError,
    InvalidParamError,
    OmniditError,
    ParallelWorkerError,
    RequestAbortedError,
    RequestFailedError,
    StageUnavailableError,
    UnknownModelError,
)
from .params import SamplingParams
from .request import EventKind, RequestEvent, RequestOutput, RequestStatus

__all__ = [
    "AsyncEngine", "BackendUnavailableError", "Engine", "EngineConfig", "EngineDeadError", "EventKind",
    "InvalidParamError", "OmniditError", "ParallelWorkerError", "RequestAbortedError", "RequestEvent",
    "RequestFailedError", "RequestOutput", "RequestStatus", "SamplingParams", "StageUnavailableError",
    "UnknownModelError",
]


def __getattr__(name):
    if name == "AsyncEngine":  # imported lazily: it starts a thread per instance, not at import
        from .async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
