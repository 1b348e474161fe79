"""JSON responses serialized with orjson: numpy arrays are written as they are (float32
vectors at float32 precision, no Python float lists in between). FastAPI's own ORJSONResponse
is deprecated."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=_OPTIONS)


def json_response(
    body: Any, status_code: int = 200, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(body, status_code, headers)
