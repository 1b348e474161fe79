"""JSON responses of the encoder routes: orjson with numpy arrays written as they are (float32
vectors at float32 precision, no Python float lists in between)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


def json_response(
    body: Any, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    content = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
    return Response(content, status_code, headers, media_type="application/json")
