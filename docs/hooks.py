"""MkDocs hooks (mkdocs.yml ``hooks:``): the generated pages' content, made from the code at build time.

A page asks for generated content with a marker line, e.g. ``<!-- generated: engine-config -->``; the
marker is replaced by what the generator returns. The benchmarks' PNG plots are added to the site under
``results/``. Generators live beside this file (gen_reference.py, gen_openapi.py, gen_results.py).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.M)
_cache: dict[str, str] = {}


def _importable() -> None:
    """The generators beside this file, and the repository's packages (mkdocs restores sys.path after
    loading a hook, so this runs in each hook)."""
    for path in (str(HERE.parent), str(HERE)):
        if path not in sys.path:
            sys.path.insert(0, path)


def _generate(name: str) -> str:
    _importable()
    from serve.quiet import quiet_third_party

    quiet_third_party()  # the build's own output only: no library chatter while the generators load models
    import gen_openapi
    import gen_reference
    import gen_results

    makers = {"engine-config": gen_reference.engine_config_markdown, "cli": gen_reference.cli_markdown,
              "http-api": gen_openapi.http_markdown, "results": gen_results.results_markdown,
              "headlines": gen_results.headlines_markdown}
    if name not in makers:
        raise KeyError(f"unknown generated section {name!r}; known: {sorted(makers)}")
    if name not in _cache:
        _cache[name] = makers[name]()
    return _cache[name]


def on_page_markdown(markdown, page, config, files):
    return MARKER.sub(lambda m: _generate(m.group(1)), markdown)


def on_files(files, config):
    from mkdocs.structure.files import File

    _importable()
    import gen_results

    for png in gen_results.plots():
        files.append(File.generated(config, f"results/{png.name}", abs_src_path=str(png)))
    return files
