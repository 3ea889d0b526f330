"""Quiet third-party output on the command line (``--verbose`` keeps it).

Set through the libraries' own documented switches (environment variables read when they
are first imported, and their logging levels), so nothing is patched."""

from __future__ import annotations

import logging
import os
import warnings

ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
LOGGERS = ("transformers", "diffusers", "vllm", "torch", "httpx", "urllib3", "filelock")


def quiet_third_party() -> None:
    for key, value in ENV.items():
        if value:
            os.environ.setdefault(key, value)
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in ("transformers", "diffusers", "torch", "vllm"):
        warnings.filterwarnings("ignore", module=module)
    warnings.filterwarnings("ignore", category=UserWarning, message=".*torchvision.*")
