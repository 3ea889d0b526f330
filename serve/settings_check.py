"""``ServeSettings`` checked before anything loads: each bad value is an ``InvalidParamError`` named by its
``omnidit serve`` flag and what it takes. ``omnidit serve`` checks right after parsing (a model load is
seconds to minutes); ``create_app`` checks again for Python callers."""

from __future__ import annotations

import math

from dit_core.errors import InvalidParamError

# field -> (flag, integer or not, the least value allowed, what 0 means when 0 is allowed below the least)
LIMITS = {
    "max_queue": ("--max-queue", True, 1, None),
    "max_body_bytes": ("--max-body-bytes", True, 1, None),
    "max_upload_bytes": ("--max-upload-bytes", True, 1, None),
    "max_prompt_chars": ("--max-prompt-chars", True, 1, None),
    "max_inflight_per_client": ("--max-inflight-per-client", True, 1, "no limit"),
    "max_pixel_steps": ("--max-pixel-steps", True, 1, "no limit"),
    "max_steps": ("--max-steps", True, 1, None),
    "file_ttl_s": ("--file-ttl", False, 0, None),
    "max_files": ("--max-files", True, 1, None),
    "max_file_bytes": ("--max-file-bytes", True, 1, None),
    "request_timeout_s": ("--request-timeout", False, 0, "no limit"),
    "max_videos": ("--max-videos", True, 1, None),
    "max_video_bytes": ("--max-video-bytes", True, 1, None),
    "video_ttl_s": ("--video-ttl", False, 0, None),
    "malloc_trim_s": ("--malloc-trim-interval", False, 0, "never"),
}


def check_settings(settings) -> None:
    """Every limit of ``settings`` in range (then the robot socket's and the upload settings)."""
    from . import image_uploads
    from .routes import robot

    for name, (flag, integer, least, zero) in LIMITS.items():
        value = getattr(settings, name)
        if not _fits(value, integer, least, zero):
            raise InvalidParamError(flag, value, _allowed(integer, least, zero))
    robot.check_settings(settings)
    image_uploads.check_settings(settings)


def check_port(port) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidParamError("--port", port, "a TCP port in [0, 65535] (0: any free port)")


def _fits(value, integer: bool, least, zero) -> bool:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return False
    if not math.isfinite(value):
        return False
    if zero is not None and value == 0:
        return True
    return value >= least if integer else value > least


def _allowed(integer: bool, least, zero) -> str:
    said = f"an integer >= {least}" if integer else f"a number of seconds > {least}"
    return said + (f" (0: {zero})" if zero is not None else "")
