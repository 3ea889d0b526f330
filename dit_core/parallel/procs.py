"""Worker processes: one launcher that starts the ranks, reports their pids and how each ended.

Rank 0 starts ``python -m dit_core.parallel`` (the launcher) with one socket pair per worker rank
and one for itself. On CPU the launcher imports what a worker needs (seconds of CPU per process,
paid once instead of once per rank) and forks the worker ranks -- before any torch thread pool
exists, as a DataLoader does. With CUDA it starts each rank as its own process instead
(``python -m dit_core.parallel --worker``): a CUDA driver touched before a fork does not work in
the child. The launcher reaps the ranks, reports how each ended and kills them if rank 0 goes
away. Workers never run the user's ``__main__`` (``-m`` start).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from ..errors import ParallelWorkerError

LAUNCH_FD_ENV = "OMNIDIT_PARALLEL_LAUNCHER_FD"
WORKER_FDS_ENV = "OMNIDIT_PARALLEL_WORKER_FDS"
WORKER_FD_ENV = "OMNIDIT_PARALLEL_WORKER_FD"
MODE_ENV = "OMNIDIT_PARALLEL_START"  # fork (CPU) or exec (CUDA)


def describe_status(status: int) -> str:
    """A waitpid status (or a negative signal number) in words."""
    if status < 0:
        return f"killed by {signal.Signals(-status).name}"
    return f"exit code {status}"


class WorkerProcesses:
    """Rank 0's handle on the launcher and the worker ranks it forked."""

    def __init__(self, ranks: list[int], threads: int, timeout_s: float, fork: bool = True):
        pairs = {rank: multiprocessing.Pipe(duplex=True) for rank in ranks}
        ours, theirs = multiprocessing.Pipe(duplex=True)
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding dit_core, for `-m`
        env.update({LAUNCH_FD_ENV: str(theirs.fileno()), "OMP_NUM_THREADS": str(threads),
                    MODE_ENV: "fork" if fork else "exec",
                    WORKER_FDS_ENV: ",".join(f"{r}:{c.fileno()}" for r, (_, c) in pairs.items()),
                    "PYTHONPATH": os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))})
        fds = [theirs.fileno()] + [c.fileno() for _, c in pairs.values()]
        self.launcher = subprocess.Popen([sys.executable, "-m", "dit_core.parallel"], pass_fds=fds, env=env,
                                         stdin=subprocess.DEVNULL)
        for conn in [theirs] + [c for _, c in pairs.values()]:
            conn.close()
        self.control = ours
        self.conns: dict[int, Connection] = {rank: mine for rank, (mine, _) in pairs.items()}
        self.status: dict[int, int] = {}  # rank -> how it ended (negative: killed by that signal)
        self.pids: dict[int, int] = {}
        self.stopped = False
        self._lock = threading.Lock()  # the engine loop and /health both read the launcher's reports
        try:
            self._await_pids(timeout_s)
        except BaseException:
            self.launcher.kill()
            self.launcher.wait()
            raise

    def _await_pids(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.pids:
            if self.control.closed or self.launcher.poll() is not None:
                code = self.launcher.wait()
                raise ParallelWorkerError(f"the parallel launcher (pid {self.launcher.pid}) ended with "
                                          f"{describe_status(code)} before starting the workers")
            if time.monotonic() > deadline:
                raise ParallelWorkerError(f"the parallel launcher did not start the workers within {timeout_s:g} s")
            if self.control.poll(0.2):
                self._drain(block=True)

    def _drain(self, block: bool = False) -> None:
        """Read the launcher's reports (pids, exits)."""
        with self._lock:
            self._read(block)

    def _read(self, block: bool) -> None:
        while not self.control.closed and (block or self.control.poll(0)):
            block = False
            try:
                msg = self.control.recv()
            except (EOFError, OSError):  # the launcher is gone; every report it sent has been read
                self.control.close()
                return
            if "pids" in msg:
                self.pids = dict(msg["pids"])
            elif "exit" in msg:
                self.status[msg["exit"]] = msg["status"]

    def ended(self, rank: int, wait_s: float = 0.0) -> str | None:
        """How worker ``rank`` ended, or None while it runs (waits up to ``wait_s`` for the report)."""
        deadline = time.monotonic() + wait_s
        while True:
            self._drain()
            if rank in self.status:
                return describe_status(self.status[rank])
            if self.control.closed:
                return "its launcher exited"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def kill(self, rank: int) -> None:
        """SIGKILL worker ``rank`` (the launcher sends it: only it knows the pid is not yet reaped)."""
        if self.ended(rank) is None:
            with self._lock, contextlib.suppress(OSError):
                self.control.send({"kill": rank})

    def stop(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for every worker to exit, kill the rest, then the launcher."""
        if self.stopped:
            return
        self.stopped = True
        deadline = time.monotonic() + grace
        for rank in self.pids:
            if self.ended(rank, max(0.0, deadline - time.monotonic())) is None:
                self.kill(rank)
        for rank in self.pids:
            self.ended(rank, 5.0)
        with self._lock, contextlib.suppress(OSError):
            self.control.close()
        try:
            self.launcher.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.launcher.kill()
            self.launcher.wait()
        for conn in self.conns.values():
            conn.close()


# ---- the launcher process (python -m dit_core.parallel) ----


def launcher_main() -> int:
    control = Connection(int(os.environ[LAUNCH_FD_ENV]))
    fds = {int(r): int(fd) for r, fd in (item.split(":") for item in os.environ[WORKER_FDS_ENV].split(","))}
    fork = os.environ.get(MODE_ENV) == "fork"
    if fork:
        from . import worker  # the imports every worker needs, done once here
        from .. import families  # noqa: F401
    pids = {}
    for rank, fd in fds.items():
        if not fork:
            env = {**os.environ, WORKER_FD_ENV: str(fd)}
            pids[rank] = subprocess.Popen([sys.executable, "-m", "dit_core.parallel", "--worker"], pass_fds=(fd,),
                                          env=env, stdin=subprocess.DEVNULL).pid
            continue
        pid = os.fork()
        if pid == 0:  # the worker rank: keep only its own connection
            for other in fds.values():
                if other != fd:
                    os.close(other)
            control.close()
            code = worker.main(Connection(fd))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        pids[rank] = pid
    for fd in fds.values():
        os.close(fd)  # so a worker's death closes its connection on rank 0's side
    live = {pid: rank for rank, pid in pids.items()}  # forked, not yet reaped: safe to signal
    control.send({"pids": pids})
    orphaned = None
    while live:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            with contextlib.suppress(OSError):
                control.send({"exit": live.pop(pid), "status": code})
            continue
        try:
            if control.poll(0.05):
                msg = control.recv()
                if msg.get("kill") in pids and pids[msg["kill"]] in live:
                    os.kill(pids[msg["kill"]], signal.SIGKILL)
        except (EOFError, OSError):  # rank 0 stopped or died: no worker may outlive it
            orphaned = orphaned or time.monotonic()
            time.sleep(0.05)
        if orphaned and time.monotonic() - orphaned > 5.0:  # an orderly stop told them already
            for pid in live:
                os.kill(pid, signal.SIGKILL)
            orphaned = float("inf")
    return 0


def worker_main() -> int:
    """A rank started as its own process (``--worker``)."""
    from . import worker

    return worker.main(Connection(int(os.environ[WORKER_FD_ENV])))
