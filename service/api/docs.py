"""Interactive API docs served offline: Swagger UI from the swagger-ui-bundle-v2 package, nothing from a CDN."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from service.errors import NotFoundError

log = logging.getLogger(__name__)

DOCS_PATH = "/docs"
ASSETS_PATH = "/docs/assets"


def swagger_ui_dir() -> Path | None:
    """The Swagger UI dist directory shipped by swagger-ui-bundle-v2, or None when the package is missing."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    path = Path(str(swagger_ui_path))
    return path if (path / "swagger-ui-bundle.js").is_file() else None


def install_docs(app: FastAPI) -> None:
    """GET /docs with Swagger UI's files served from /docs/assets; build the app with `docs_url=None, redoc_url=None`.

    Relative URLs, so the page also works behind a proxy that serves the app under a path prefix. Without the
    package, /docs is a 404 that points to /openapi.json (which never needs anything from outside).
    """
    assets = swagger_ui_dir()
    if assets is None:
        log.warning("swagger-ui-bundle-v2 is not installed: /docs is off, /openapi.json still works")
    else:
        app.mount(ASSETS_PATH, StaticFiles(directory=assets), name="docs-assets")

    @app.get(DOCS_PATH, include_in_schema=False, response_class=HTMLResponse)
    async def docs() -> HTMLResponse:
        if assets is None:
            raise NotFoundError("interactive docs need the swagger-ui-bundle-v2 package; the schema is at /openapi.json")
        return get_swagger_ui_html(
            openapi_url="openapi.json",
            title=f"{app.title} - API docs",
            swagger_js_url="docs/assets/swagger-ui-bundle.js",
            swagger_css_url="docs/assets/swagger-ui.css",
            swagger_favicon_url="docs/assets/favicon-32x32.png",
            swagger_ui_parameters={"validatorUrl": None},  # the default validator badge loads from an outside host
        )


def install_openapi(app: FastAPI, model_name: Callable[[], str]) -> None:
    """/openapi.json names the served model in its summary (`model_name()`: the manifest's model, "" while loading).
    The schema is built once the model is known and kept; while the model loads it is built per request."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        name = model_name()
        app.summary = f"{name or 'CosyVoice'} text-to-speech on ONNX Runtime (CPU)" + ("" if name else "; the model is loading")
        schema = build()
        if not name:
            app.openapi_schema = None  # built again once the model is loaded
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
