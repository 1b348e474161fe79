"""CSV cells a spreadsheet never runs: text that would start a formula is quoted (OWASP's CSV
injection advice) before any CSV export writes it."""

from __future__ import annotations

from typing import Any

# What makes Excel, LibreOffice or Google Sheets read a cell as a formula (or DDE).
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "\n", "\uff1d", "\uff0b", "\uff0d", "\uff20")


def csv_cell(value: Any) -> Any:
    """`value` for a CSV export: a string starting like a formula gets a leading `'` (shown as
    text, the rest kept); numbers and everything else go out as they are."""
    if isinstance(value, str) and value.startswith(_FORMULA_STARTS):
        return "'" + value
    return value


def csv_row(values: list[Any]) -> list[Any]:
    return [csv_cell(v) for v in values]
