"""The robot socket's server-wide bounds (serve.routes.robot): how many sessions may be open, and how
large a frame may be. No heavy imports: the CLI shows these defaults before loading anything."""

from __future__ import annotations

import os

MIB = 1 << 20
SESSIONS_PER_CORE = 8


def default_max_sessions() -> int:
    """``--max-robot-sessions``' default: 8 per CPU core, at least 16. A session holds at most one
    request in the engine and one frame in memory (at most twice ``--max-ws-frame-mb`` before the
    WebSocket layer cuts it), so this bounds both the robots' share of the queue and the frames held."""
    return max(16, SESSIONS_PER_CORE * (os.cpu_count() or 1))


def frame_limit_bytes(settings) -> int:
    """The largest frame the robot socket takes (``--max-ws-frame-mb``, in MiB)."""
    return int(settings.max_ws_frame_mb * MIB)


class SessionSlots:
    """The open robot sessions of one app, at most ``limit``. Used from the event loop only."""

    def __init__(self, limit: int):
        self.limit, self.open = limit, 0

    def take(self) -> bool:
        """Count one more session; False (nothing counted) when ``limit`` are already open."""
        if self.open >= self.limit:
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1
