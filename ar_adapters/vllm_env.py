"""Starting a vLLM engine without changing this process's environment for everything else in it.

Importing vLLM, and building an ``LLM`` on CPU, write settings for vLLM's own processes into
``os.environ``: ``TORCHINDUCTOR_COMPILE_THREADS=1``, ``TORCHINDUCTOR_CPP_DYNAMIC_THREADS``,
``LD_PRELOAD``, ``NUMEXPR_MAX_THREADS`` and more. Left there, they reach the rest of an omnidit
process and every process it starts later (parallel ranks, servers): a compiled server started
from a test process in which a vLLM stage had run built its kernels on one thread and missed the
inductor cache written without those settings (its warm-up took 34 s instead of 11 s).

``contained()`` keeps them to vLLM: the environment is restored once the ``LLM`` is built (inside
``vllm_memory.explicit_kv_cache``, whose lock makes it one engine start at a time). vLLM's
engine processes are spawned while it is being built, so they still start with its settings, and
each re-imports vLLM, which sets them again there. torch's inductor settings are read (imported)
before vLLM is, so this process's compile threads stay what torch decides from the environment.
"""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def contained():
    """Import vLLM / build an ``LLM`` inside this block; ``os.environ`` is as before afterwards."""
    import torch._inductor.config  # noqa: F401 - read before vLLM's overrides are in the environment

    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in saved]:
            del os.environ[key]
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
