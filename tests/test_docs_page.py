"""`/docs` works on a host without internet: the page references only this server's own
assets (Swagger UI's script, stylesheet and icon), and the server answers each of them."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.platform_harness import PlatformProcess


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlatformProcess]:
    p = PlatformProcess(tmp_path_factory.mktemp("docs")).start()
    try:
        yield p
    finally:
        p.stop()


def test_docs_references_only_same_origin_assets_and_serves_them(
    platform: PlatformProcess,
) -> None:
    page = httpx.get(f"{platform.url}/docs")
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    # Everything the page loads: <script src>, <link href>, and the schema it fetches.
    references = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    references += re.findall(r"url: '([^']+)'", page.text)
    assert references, page.text
    for ref in references:
        # Before: https://cdn.jsdelivr.net/… and https://fastapi.tiangolo.com/img/favicon.png.
        assert ref.startswith("/") and not ref.startswith("//"), ref
    kinds = {"javascript": 0, "css": 0, "image": 0, "json": 0}
    for ref in references:
        answer = httpx.get(f"{platform.url}{ref}")
        assert answer.status_code == 200 and answer.content, ref
        for kind in kinds:
            kinds[kind] += kind in answer.headers["content-type"]
    assert all(kinds.values()), kinds  # the script, the stylesheet, the icon and the schema


def test_only_the_pages_own_assets_are_served(platform: PlatformProcess) -> None:
    for name in ("redoc.standalone.js", "..%2Fcore.py", "missing.js"):
        answer = httpx.get(f"{platform.url}/docs/assets/{name}")
        assert answer.status_code == 404, name
