"""``python -m dit_core.parallel``: the launcher of worker ranks, or (``--worker``) one rank started
as its own process; see ``procs.py``. Started by rank 0, never by hand."""

import os
import sys

from .procs import launcher_main, worker_main

code = worker_main() if "--worker" in sys.argv[1:] else launcher_main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # nothing to tear down: skip the interpreter's (slow) exit with torch loaded
