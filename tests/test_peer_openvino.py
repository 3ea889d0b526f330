"""benchmarks.peer_openvino: OpenVINO stays out of omnidit's environment, and the benchmark runs
(--quick) where its own environment is built."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_benchmark_imports_no_openvino_and_help_works():
    code = ("import sys, benchmarks.peer_openvino as p; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('openvino', 'optimum', 'torch')]; "
            "assert not bad, bad; print(p.venv_dir())")
    env = {**os.environ, "OMNIDIT_PEER_OPENVINO_VENV": "/nonexistent/peer"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "/nonexistent/peer"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.peer_openvino", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--build-env" in proc.stdout and "OMNIDIT_PEER_OPENVINO_VENV" in proc.stdout
    # an unbuilt environment with --no-build fails, saying how to build it, and builds nothing
    proc = subprocess.run([sys.executable, "-m", "benchmarks.peer_openvino", "--quick", "--no-build"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--build-env" in proc.stderr
    assert not Path("/nonexistent/peer").exists()


def test_quick_run_writes_every_summary_key(tmp_path):
    from benchmarks import peer_openvino as p

    if not p.venv_ready():
        pytest.skip(f"the OpenVINO peer environment is not built at {p.venv_dir()}: build it with "
                    "`python -m benchmarks.peer_openvino --build-env` (or set OMNIDIT_PEER_OPENVINO_VENV to a "
                    "built one) to run this test")
    results = ROOT / "benchmarks" / "results" / "peer_openvino_quick.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.peer_openvino", "--quick", "--no-build"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(results.read_text())["summary"]
    assert set(p.SUMMARY_KEYS) <= set(summary)
    assert summary["openvino_matches_diffusers"] is True
    assert summary["omnidit_over_diffusers"] > 0 and summary["omnidit_fp32_over_openvino_f32"] > 0
