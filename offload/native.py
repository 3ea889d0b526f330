"""Small C++ libraries built here against torch, cached and verified before every load.

Used by the reuse allocator (``offload.reuse``) and the CPU GELU kernel (``dit_core.cpu_gelu``). A
library is compiled with the system C++ compiler on first use and cached under
``~/.cache/omnidit/ext`` (or ``$OMNIDIT_CACHE_DIR/ext``) with a record of what built it: the hash
of the source, the torch build (version, git revision, C++ ABI, include and library paths), the
compiler (its path and ``--version``), the flags, and the hash of the library's bytes. A cached
library is loaded only when its record matches all of these and its bytes hash to the recorded
value; otherwise (corrupt, truncated, replaced, or built from another source, torch, compiler or
flags) it is rebuilt. The bytes that were hashed are the bytes loaded (from an in-memory file where
Linux has ``memfd_create``), so the file cannot change between the check and the load. The compiler
must be present at every start, loading a cached build included (its identity is part of the check).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


class NativeUnavailable(RuntimeError):
    """A library cannot be built or loaded here (no C++ compiler, no torch headers, ...)."""


def cache_dir() -> Path:
    root = os.environ.get("OMNIDIT_CACHE_DIR") or Path.home() / ".cache" / "omnidit"
    return Path(root) / "ext"


def torch_flags(libraries=("c10",), extra=(), std: str = "c++17") -> list[str]:
    """Compiler flags for a shared library against this process's torch: its headers, the C++ ABI,
    and linked to ``libraries`` of torch's ``lib`` folder (found there at run time too)."""
    import torch
    from torch.utils import cpp_extension

    lib_dir = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    return ["-O2", "-shared", "-fPIC", f"-std={std}", "-pthread", *extra, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *includes, f"-L{lib_dir}", *(f"-l{name}" for name in libraries), f"-Wl,-rpath,{lib_dir}"]


def compiler() -> tuple[str, str]:
    """The C++ compiler (``$CXX``, else g++ or c++ on the PATH) and its identity: resolved path and
    ``--version`` output, which a cached library's record must match."""
    path = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not path:
        raise NativeUnavailable("no C++ compiler (set CXX, or install g++)")
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeUnavailable(f"{path} did not run: {e}") from None
    if done.returncode != 0:
        raise NativeUnavailable(f"{path} --version failed: {done.stderr.strip()[-200:]}")
    return path, f"{shutil.which(path) or path}\n{done.stdout.strip()}"


def build_inputs(source: Path, compiler_id: str, flags: list[str]) -> dict:
    """What a library is built from, as its record keeps it: the source's hash, the torch build,
    the compiler's identity and the flags."""
    import torch

    return {"source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
            "torch": f"{torch.__version__} git={torch.version.git_version} debug={torch.version.debug}",
            "compiler": compiler_id, "flags": flags}


def _record_path(target: Path) -> Path:
    return target.with_suffix(".json")


def _verified(target: Path, inputs: dict, what: str) -> bytes | None:
    """The cached library's bytes when its record matches ``inputs`` and the bytes' hash; None
    (with the reason logged) when it must be rebuilt."""
    if not target.exists():
        return None
    try:
        record = json.loads(_record_path(target).read_text())
        data = target.read_bytes()
    except (OSError, ValueError) as e:
        logger.warning("%s: cached %s has no readable record (%s); rebuilding", what, target.name, e)
        return None
    if not isinstance(record, dict) or record.get("inputs") != inputs:
        logger.warning("%s: cached %s was built from other inputs; rebuilding", what, target.name)
        return None
    if record.get("so_sha256") != hashlib.sha256(data).hexdigest():
        logger.warning("%s: cached %s does not match its recorded hash; rebuilding", what, target.name)
        return None
    return data


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a concurrent build of the same key writes the same content
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_verified(source: Path, name: str, flags: list[str], what: str) -> tuple[Path, bytes]:
    """The library's path and verified bytes: the cached build of ``source`` with ``flags`` when its
    record matches, else compiled now (and recorded). ``name``: the file's stem; ``what``: the
    library in log lines and errors."""
    path, compiler_id = compiler()
    inputs = build_inputs(source, compiler_id, flags)
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    target = cache_dir() / f"{name}-{key[:16]}.so"
    data = _verified(target, inputs, what)
    if data is not None:
        return target, data
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        try:
            done = subprocess.run([path, str(source), "-o", str(out), *flags], capture_output=True, text=True,
                                  timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeUnavailable(f"{path} did not run: {e}") from None
        if done.returncode != 0:
            raise NativeUnavailable(f"{path} failed on {source.name}: {done.stderr.strip()[-400:]}")
        data = out.read_bytes()
    _write_atomic(target, data)
    record = {"inputs": inputs, "so_sha256": hashlib.sha256(data).hexdigest()}
    _write_atomic(_record_path(target), json.dumps(record, indent=1).encode())
    logger.info("%s: built %s", what, target)
    return target, data


_loaded_fds: list[int] = []  # the in-memory files of the libraries loaded, kept open: see open_library


def open_library(data: bytes, path: Path, memfd_name: str) -> ctypes.CDLL:
    """Load exactly ``data`` (the verified bytes) through an in-memory file, or ``path`` where
    there is no ``memfd_create``.

    The file stays open for the process's life: the loader knows a library by the path it was
    opened from (``/proc/self/fd/N``), so had the descriptor been closed, the next library loaded
    through the same descriptor number would be taken for this one and not loaded at all."""
    if not hasattr(os, "memfd_create"):
        return ctypes.CDLL(str(path))
    fd = os.memfd_create(memfd_name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        library = ctypes.CDLL(f"/proc/self/fd/{fd}")
    except BaseException:
        os.close(fd)
        raise
    _loaded_fds.append(fd)
    return library
