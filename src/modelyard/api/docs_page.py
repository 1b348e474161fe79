"""`/docs` served from this server alone: FastAPI's default page loads Swagger UI's script and
stylesheet from a CDN (and its icon from fastapi.tiangolo.com), so on a host without internet it
stays blank. The assets here are the copy the `fastapi-offline` package ships (Swagger UI 5,
which renders the OpenAPI 3.1 schema FastAPI writes), answered from `/docs/assets/`.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse

from modelyard.protocol.errors import APIError

ASSETS_URL = "/docs/assets"
_ASSETS = Path(str(files("fastapi_offline") / "static"))
# Only what the page uses; the package also ships ReDoc, which this API does not serve.
_FILES = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon.png": "image/png",
}


def install_docs(app: FastAPI) -> None:
    """Serve `/docs` (build the app with `docs_url=None`) and the assets it references."""
    assert app.openapi_url is not None and app.swagger_ui_oauth2_redirect_url is not None
    openapi_url, redirect_url = app.openapi_url, app.swagger_ui_oauth2_redirect_url

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=root + redirect_url,
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
        )

    @app.get(redirect_url, include_in_schema=False)
    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(ASSETS_URL + "/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        media_type = _FILES.get(name)
        if media_type is None:
            raise APIError(404, f"No documentation asset {name!r}.", code="not_found")
        return FileResponse(_ASSETS / name, media_type=media_type)
