"""The playground page: ``GET /`` and its static files (plain HTML, CSS and ES modules shipped in
``serve/static``; no build step, nothing fetched from another host).

The page holds no secret, so ``/`` and ``/static/`` are open even with ``--api-key``; the page asks
the person for the key and sends it with its API calls."""

from __future__ import annotations

import html
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
OPEN_PATHS = ("/",)
OPEN_PREFIXES = ("/static/",)
router = APIRouter()


def tab_kinds() -> list[str]:
    """Output kinds that have a tab module (``static/tabs/KIND.js``); the page imports only these."""
    return sorted(p.stem for p in (STATIC / "tabs").glob("*.js") if not p.stem.startswith("_"))


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def page() -> HTMLResponse:
    text = (STATIC / "index.html").read_text(encoding="utf-8")
    text = text.replace("{{TABS}}", html.escape(",".join(tab_kinds()), quote=True))
    return HTMLResponse(text, headers={"Cache-Control": "no-cache"})


def install(app: FastAPI) -> None:
    """Serve the page at ``/`` and its files under ``/static``."""
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
