"""Schema-driven fuzzing of the HTTP API with schemathesis (every check, every phase it runs by default)
against a live server serving one tiny model of each kind (benchmarks/live.py).

    python -m benchmarks.fuzz [--max-examples 60] [--seed 1] [--api-key KEY]

Writes benchmarks/results/fuzz.json: summary {fuzz_cases, fuzz_failures, operations, seconds}. The
test suite runs the same thing with few examples (tests/test_openapi_fuzz.py); benchmarks/soak.py
runs it at its own count.

Why ``positive_data_acceptance`` also accepts 400: the schema states every field's type and range,
but some rules depend on the model (a size must be a multiple of the model's factor, the work a
request asks must fit the server's bound); a schema-valid request that breaks one gets the OpenAI
400 body naming the field, which the other checks still verify.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import machine, write_json

# statuses a schema-valid request may get: success, a model-dependent 400, an unknown id's 404, and
# the documented back-pressure answers (queue full, per-client limit, timeout)
POSITIVE_OK = "2xx,400,401,404,429,504"
# a shared 2-core machine under load answers a tiny video in seconds, not milliseconds; every answer
# still comes within the server's request timeout (30 s in benchmarks.live) plus the encoding
RESPONSE_LIMIT_S = 60


def st_binary() -> str:
    found = Path(sys.executable).with_name("st")
    return str(found) if found.exists() else (shutil.which("st") or "st")


def run_fuzz(url: str, max_examples: int = 10, seed: int = 1, api_key: str | None = None,
             workers: int = 1, timeout_s: float = 600, phases: str | None = None) -> dict:
    """Run schemathesis against ``url``; returns {cases, failures, operations, seconds, failed, output}."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "schemathesis.toml"
        config.write_text(f"""
[checks.positive_data_acceptance]
expected-statuses = {json.dumps(POSITIVE_OK.split(","))}

[checks]
max_response_time = {RESPONSE_LIMIT_S}
""")
        report = Path(tmp) / "report.ndjson"
        cmd = [st_binary(), "--config-file", str(config), "run", f"{url}/openapi.json", "--checks", "all",
               "--max-examples", str(max_examples), "--seed", str(seed), "--workers", str(workers),
               "--request-timeout", "60", "--no-shrink", "--report", "ndjson", "--report-ndjson-path", str(report),
               "--suppress-health-check", "all"]
        if phases:
            cmd += ["--phases", phases]
        if api_key:
            cmd += ["-H", f"Authorization: Bearer {api_key}"]
        start = time.monotonic()
        # run in the temporary folder: schemathesis keeps a cache (.schemathesis/) in its working directory
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=tmp,
                              env={**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_TELEMETRY": "false"})
        seconds = time.monotonic() - start
        cases, failures, operations = _count(report)
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("_", "- ", "FAILED", "❌"))]
    return {"cases": cases, "failures": failures if proc.returncode == 0 or failures else max(failures, 1),
            "operations": operations, "seconds": seconds, "returncode": proc.returncode, "failed": failed,
            "output": proc.stdout[-6000:] + proc.stderr[-2000:]}


def _count(report: Path) -> tuple[int, int, int]:
    """(test cases sent, distinct failures, operations tested) from the ndjson event report."""
    cases, failures, operations = 0, set(), set()
    if not report.exists():
        return 0, 0, 0
    for line in report.read_text().splitlines():
        event = json.loads(line)
        for kind, body in event.items():
            if kind != "ScenarioFinished":
                continue
            recorder = body.get("recorder") or {}
            label = recorder.get("label")
            if label:
                operations.add(label)
            cases += len(recorder.get("cases") or {})
            for case_checks in (recorder.get("checks") or {}).values():
                for check in case_checks:
                    if check.get("status") == "FAILURE":
                        failures.add((label, check.get("name"), (check.get("failure_info") or {}).get("code")))
    return cases, len(failures), len(operations)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=60, help="test cases per operation and phase")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--api-key", default=None, help="serve with this API key and send it")
    parser.add_argument("--quick", action="store_true", help="10 examples per operation")
    args = parser.parse_args(argv)
    from benchmarks.live import build_models, live_server, reliability_settings

    n = 10 if args.quick else args.max_examples
    with tempfile.TemporaryDirectory() as tmp:
        models = build_models(tmp)
        with live_server(models, reliability_settings(api_key=args.api_key)) as live:
            result = run_fuzz(live.url, n, args.seed, args.api_key)
    print(result["output"])
    summary = {"fuzz_cases": result["cases"], "fuzz_failures": result["failures"],
               "operations": result["operations"], "seconds": round(result["seconds"], 1), "max_examples": n}
    print(json.dumps(summary))
    write_json("fuzz", {"summary": summary, "machine": machine(), "failed": result["failed"]})
    return 0 if result["failures"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
