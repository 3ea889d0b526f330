"""``omnidit`` command lines run through ``serve.cli.main``, several in ONE fresh process (each start of a
process pays the torch / diffusers imports): for the CLI tests and the docs' command-line examples."""

from __future__ import annotations

import json
import subprocess
import sys

CALLS = """
import contextlib, io, json, sys
from serve.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def omnidit_calls(*calls, cwd=None, timeout: float = 300) -> list[tuple]:
    """Per command line (a sequence of arguments after ``omnidit``): (exit code, stderr), run in ``cwd``."""
    r = subprocess.run([sys.executable, "-c", CALLS, json.dumps([list(map(str, c)) for c in calls])],
                       capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return [tuple(x) for x in json.loads(r.stdout.strip().splitlines()[-1])]
