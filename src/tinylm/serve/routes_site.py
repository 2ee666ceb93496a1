"""What a server shows beside its API: ``/health``, the playground page at ``/`` and its files, and the API's
interactive docs (``/docs``, ``/redoc``).

FastAPI's own /docs and /redoc pages load their scripts from a CDN, so offline they are blank; these are the
same pages with the scripts served from the installed fastapi-offline package (`mount_files`).
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
# Swagger UI's and ReDoc's own files, for /docs and /redoc, from the fastapi-offline package (which ships them)
DOCS_ASSETS = Path(importlib.resources.files("fastapi_offline") / "static")
DOCS_ASSETS_URL = "/static/docs"

router = APIRouter()


# HEAD: load balancers' and monitors' liveness probe. It is GET without the body, so the docs list GET alone:
# one route for both would put two operations with one operation id in /openapi.json
@router.head("/health", include_in_schema=False)
@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    state = request.app.state
    return {"status": "ok", "model": state.model.name, "scheduler": state.scheduler.stats()}


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html")


@router.get("/docs", include_in_schema=False)
async def docs(request: Request) -> Response:
    return get_swagger_ui_html(openapi_url=request.app.openapi_url, title="tinylm: the API",
                               swagger_js_url=f"{DOCS_ASSETS_URL}/swagger-ui-bundle.js",
                               swagger_css_url=f"{DOCS_ASSETS_URL}/swagger-ui.css",
                               swagger_favicon_url=f"{DOCS_ASSETS_URL}/favicon.png")


@router.get("/redoc", include_in_schema=False)
async def redoc(request: Request) -> Response:
    return get_redoc_html(openapi_url=request.app.openapi_url, title="tinylm: the API",
                          redoc_js_url=f"{DOCS_ASSETS_URL}/redoc.standalone.js",
                          redoc_favicon_url=f"{DOCS_ASSETS_URL}/favicon.png", with_google_fonts=False)


def mount_files(app: FastAPI) -> None:
    """The page's files and the docs' scripts, under /static/, which the API key leaves open like the page."""
    app.mount(DOCS_ASSETS_URL, StaticFiles(directory=DOCS_ASSETS), name="docs-assets")  # mounted first, so it wins
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
