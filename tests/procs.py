"""Looking at processes by pid (the parallel tests check that no worker outlives its engine)."""

import contextlib
import os


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def run_together(jobs: list[tuple[list[str], dict]], timeout: float = 300) -> list[str]:
    """Run each (command, environment) in its own process, all started at once; their stdouts in order.

    A test process starting python spends seconds of one core importing torch and diffusers; started
    together, those imports overlap on a 2-core machine. Only for processes whose results do not depend
    on timing (outputs, peak memory): each fails the test with its stderr when it exits non-zero."""
    import subprocess

    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, env in jobs]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs
