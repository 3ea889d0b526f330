"""The documentation site: it builds with ``mkdocs build --strict`` (broken links, missing pages and
unknown anchors fail), offline, and its generated references hold every EngineConfig field, every
``omnidit`` flag, every HTTP route and every benchmark result; a field or flag without a description
fails here."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).parent / "mkdocs"


def _load(name: str):
    sys.path[:0] = [str(ROOT / "docs")]
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "docs"))


gen_reference = _load("gen_reference")


def test_every_engine_config_field_and_cli_flag_has_a_description():
    assert gen_reference.missing_descriptions() == []


def test_the_python_guide_lists_every_sampling_param():
    """Every ``SamplingParams`` field has a row (its name in backticks in the first column) in the Python
    API guide's table."""
    from dit_core import SamplingParams

    rows = re.findall(r"^\| ([^|]+) \|", (ROOT / "docs" / "guide" / "python-api.md").read_text(), re.M)
    listed = {name for row in rows for name in re.findall(r"`(\w+)`", row)}
    assert [f.name for f in dataclasses.fields(SamplingParams) if f.name not in listed] == []


def test_a_field_without_a_description_is_reported():
    @dataclasses.dataclass
    class Config:
        """How it runs.

        alpha, beta: two fields
            described together.
        gamma: one more.
        """

        alpha: int = 1
        beta: int = 2
        gamma: int = 3
        delta: int = 4

    docs = gen_reference.field_docs(Config)
    assert docs == {"alpha": "two fields described together.", "beta": "two fields described together.",
                    "gamma": "one more."}
    assert "delta" not in docs


def test_a_flag_without_help_is_reported():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--seen", help="has one")
    parser.add_argument("--unseen")
    rows = [r for _, group in gen_reference.flag_rows(parser) for r in group]
    assert {r["flag"]: bool(r["help"]) for r in rows} == {"--seen": True, "--unseen": False}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def text_of(site: Path, page: str) -> str:
    html = (site / page / "index.html").read_text()
    return re.sub(r"<[^>]+>", "", html)


def test_the_site_builds_strict_with_every_page(site):
    nav = re.findall(r":\s+([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert len(nav) >= 25
    for page in nav:
        built = site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert built.exists(), page


def test_the_configuration_reference_lists_every_field(site):
    from dit_core.config import EngineConfig

    text = text_of(site, "reference/configuration")
    for f in dataclasses.fields(EngineConfig):
        assert f.name in text, f.name


def test_the_cli_reference_lists_every_flag(site):
    from serve.cli import build_parser

    text = text_of(site, "reference/cli")
    for name, _, sub in gen_reference.subcommands(build_parser()):
        assert f"omnidit {name}" in text
        for _, rows in gen_reference.flag_rows(sub):
            for r in rows:
                assert r["flag"] in text, (name, r["flag"])


def test_the_http_reference_is_the_servers_openapi_document(site):
    text = text_of(site, "reference/http-api")
    html = (site / "reference/http-api/index.html").read_text()
    for path in ("/v1/images/generations", "/v1/videos", "/v1/audio/speech", "/health/ready", "/v1/engine/stats"):
        assert f"{path}" in text, path
    assert 'id="schema-errorresponse"' in html


def test_the_results_page_shows_every_result_file(site):
    text = text_of(site, "results")
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        assert path.stem in text, path.name
        summary = json.loads(path.read_text()).get("summary") or {}
        for key in summary:
            assert key in text, (path.name, key)


def test_python_api_reference_is_rendered_from_docstrings(site):
    text = text_of(site, "reference/python-api")
    for name in ("Engine", "AsyncEngine", "SamplingParams", "EngineConfig", "register_backend", "family_class"):
        assert name in text
    assert "add_request" in text and "run_to_completion" in text


def test_the_readme_is_short_and_every_capability_is_one_click_away():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "make run" in readme and "make test" in readme  # .ci/run runs the README's test command
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not link.startswith("http")]
    for link in local:
        assert (ROOT / link).exists(), link
    for page in sorted((ROOT / "docs" / "guide").glob("*.md")):
        assert f"docs/guide/{page.name}" in local, f"README does not link {page.name}"
