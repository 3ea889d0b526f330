"""Every example the docs include runs: the files under examples/ that docs pages pull in with
``--8<-- "examples/NAME"`` are executed here, the in-process ones as they are and the HTTP ones against
one live server holding the four embedded models. A renamed argument breaks this test, not a reader."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from dit_core.zoo import default_model, default_policy, default_video_model, tts_model
from serve.app import ServeSettings
from serve_helpers import live_server

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# example -> the files it writes (checked after it runs)
IN_PROCESS = {"first_image.py": ["seven.png", "three.png"], "python_api.py": [], "async_stream.py": ["six.png"],
              "multi_model.py": [],
              "first_video.py": ["three.mp4"], "robot_infer.py": []}
OVER_HTTP = {"openai_images.py": ["7_0.png", "7_1.png"],
             "openai_edits.py": ["seven.png", "one.png", "inpainted.png"], "first_speech.py": ["314.wav"],
             "openai_videos.py": ["five.mp4"], "openpi_client.py": [], "quickstart.sh": ["7.png", "seven.png"]}
# run by another test module against its own policy server
ELSEWHERE = {"robot_loop.py": "tests/test_openpi_socket.py::test_the_robot_loop_example_runs_against_the_server"}


def included_examples() -> set[str]:
    names = set()
    for page in (ROOT / "docs").rglob("*.md"):
        names |= set(re.findall(r'--8<-- "examples/([^"]+)"', page.read_text()))
    return names


def test_every_included_example_is_run_by_a_test():
    included = included_examples()
    assert included, "no page includes an example: the snippet marker changed?"
    assert included <= set(IN_PROCESS) | set(OVER_HTTP) | set(ELSEWHERE)
    for name in [*IN_PROCESS, *OVER_HTTP]:
        assert (EXAMPLES / name).exists(), name


EMBEDDED = re.compile(r"\b(digits|digits_video|tts|reach|dit_core\.zoo|default_model|default_policy)\b")


def test_python_blocks_with_embedded_models_are_included_examples():
    """A Python block of a page that uses an embedded model is an included example file (so it runs here),
    or says on the line before it why it is not executed."""
    loose = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text()
        for m in re.finditer(r"(^[^\n]*\n)?```python\n(.*?)```", text, re.S | re.M):
            before, body = m.group(1) or "", m.group(2)
            if "--8<--" not in body and EMBEDDED.search(body) and "<!-- not executed:" not in before:
                loose.append(f"{page.relative_to(ROOT)}: {body[:80]!r}")
    assert loose == []


@pytest.mark.parametrize("name", sorted(IN_PROCESS))
def test_in_process_example_runs(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    for out in IN_PROCESS[name]:
        assert (tmp_path / out).stat().st_size > 0, out
    assert capsys.readouterr().out.strip()


@pytest.fixture(scope="module")
def server():
    models = {"digits": str(default_model()), "digits_video": str(default_video_model()), "tts": str(tts_model()),
              "reach": str(default_policy())}
    with live_server(models, ServeSettings(), dtype="float32") as live:
        yield live


@pytest.mark.parametrize("name", sorted(OVER_HTTP))
def test_http_example_runs(name, server, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMNIDIT_URL", server.url)
    if name.endswith(".sh"):
        env = {**os.environ, "OMNIDIT": str(Path(sys.executable).parent / "omnidit"), "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(["bash", str(EXAMPLES / name)], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "digits" in done.stdout
    else:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
        assert capsys.readouterr().out.strip()
    for out in OVER_HTTP[name]:
        assert (tmp_path / out).stat().st_size > 0, out
