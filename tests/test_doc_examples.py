"""Every example the docs include runs: the files under examples/ that docs pages pull in with
``--8<-- "examples/NAME"`` are executed here, the in-process ones as they are and the HTTP ones against
one live server holding the four embedded models; and every ``omnidit generate`` line of a page's bash
blocks that needs no checkpoint of the reader's own. A renamed argument breaks this test, not a reader."""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cli_calls import omnidit_calls
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


def cli_examples() -> list[tuple[str, list[str]]]:
    """(page, arguments after ``omnidit``) of every ``omnidit generate`` line in the docs' bash blocks (and
    the README's) that names no placeholder (an upper-case word like ``MODEL_DIR``) and is not a synopsis
    (``[...]``)."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in block.splitlines():
                m = re.match(r"\s*(?:\.venv/bin/)?omnidit (generate .*)", line)
                if not m or "[" in line:
                    continue
                argv = shlex.split(m.group(1), comments=True)
                if not any(re.fullmatch(r"[A-Z][A-Z0-9_]*", a) for a in argv):
                    found.append((str(page.relative_to(ROOT)), argv))
    return found


def test_cli_examples_run(tmp_path):
    """Each such line runs as written (in a folder holding the pictures the lines name; a path into the
    repository as from its root), exits 0 and writes the one file its ``-o`` names."""
    examples = cli_examples()
    pages = {page for page, _ in examples}
    assert {"README.md", "docs/guide/images.md", "docs/guide/lora.md"} <= pages, pages
    y, x = np.mgrid[0:32, 0:32]
    Image.fromarray(np.stack([x * 8, y * 8, (x * y) % 256], axis=-1).astype(np.uint8)).save(tmp_path / "seven.png")
    Image.fromarray(((x >= 16) * 255).astype(np.uint8)).save(tmp_path / "right_half.png")
    calls = [[a if not a.split("=", 1)[-1].startswith("dit_core/") else a.replace("dit_core/", f"{ROOT}/dit_core/")
              for a in argv] for _, argv in examples]
    for (page, argv), (code, err) in zip(examples, omnidit_calls(*calls, cwd=tmp_path, timeout=600)):
        assert code == 0, f"{page}: omnidit {shlex.join(argv)}: {err[-1000:]}"
        out = Path(argv[argv.index("-o") + 1])
        assert (tmp_path / out).stat().st_size > 0, (page, argv)
        assert not list(tmp_path.glob(f"{out.stem}_*{out.suffix}")), (page, argv)  # one prompt: one file


def test_every_omnidit_line_of_the_docs_parses():
    """Every ``omnidit`` line of a bash block in the docs (not a ``[...]`` synopsis; continuation lines
    joined) parses with the CLI's own parser, a placeholder (``MODEL_DIR``) standing for a value: a flag
    renamed or dropped fails here, not for a reader."""
    from serve.cli import build_parser

    lines = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                m = re.match(r"\s*(?:\.venv/bin/)?omnidit (.*?)\s*&?\s*$", line.split(" #")[0])
                if m and "[" not in line:
                    lines.append((str(page.relative_to(ROOT)), shlex.split(m.group(1))))
    assert len(lines) >= 10, lines
    parser = build_parser()
    for page, argv in lines:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{page}: omnidit {shlex.join(argv)} does not parse")
