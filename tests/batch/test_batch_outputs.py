"""Output files of batches: every line is one line for any reader."""

from __future__ import annotations

import json
from types import SimpleNamespace

from modelyard.batch.outputs import _line


def test_output_lines_survive_readers_that_split_on_unicode_separators() -> None:
    # A model may generate U+2028, U+2029 or U+0085: JSON leaves them unescaped, but Python's
    # str.splitlines() (which users and the OpenAI cookbook apply to output files) splits on them.
    text = "a\u2028b\u2029c\x85d\x1ce\nf"
    item = SimpleNamespace(
        id=7, custom_id="x", status_code=200, request_id="r", response={"text": text}, error=None
    )
    decoded = _line(item).decode()  # type: ignore[arg-type]
    assert len(decoded.splitlines()) == 1
    assert json.loads(decoded)["response"]["body"]["text"] == text
