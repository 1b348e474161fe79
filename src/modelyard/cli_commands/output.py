"""How commands print: rich tables for people, `--json` for scripts, errors as one line.

Whatever the platform answers may hold text a tenant chose (model names, messages, errors), and
a terminal obeys escape sequences: everything printed for people goes through `safe` (or
`printable`) first, which shows control characters as escapes (`\\x1b`) and makes rich markup
literal. `--json` needs nothing: JSON escapes control characters itself."""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from modelyard.cli_commands.client import ApiError
from modelyard.cli_commands.profiles import ProfileError

console = Console()
errors = Console(stderr=True)

Column = tuple[str, Callable[[dict[str, Any]], Any]]


# C0 and C1 controls, DEL, and the bidirectional overrides that reorder what a terminal shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: Any) -> str:
    """`value` as text a terminal shows and never obeys: control characters as escapes."""
    return _CONTROL.sub(_escaped, str(value))


def safe(value: Any) -> Any:
    """`value` (a platform's answer: dicts, lists, strings…) with every string, keys too,
    `printable` and its rich markup made literal, ready for tables and markup lines."""
    if isinstance(value, str):
        return escape(printable(value))
    if isinstance(value, dict):
        return {safe(k): safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [safe(v) for v in value]
    return value


@contextmanager
def api_errors() -> Iterator[None]:
    """An API refusal or an unusable profile: its message on stderr and exit 1, no traceback."""
    try:
        yield
    except (ApiError, ProfileError) as exc:
        message = safe(str(exc))
        errors.print(f"[red]error:[/red] {message}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def when(ts: int | None) -> str:
    if not ts:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M")


def field(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda row: row.get(name)


_WHOLE = frozenset({"ID", "TENANT", "PREFIX", "INPUT", "OUTPUT", "REF", "DEVICE"})


def table(rows: Sequence[dict[str, Any]], columns: Sequence[Column], title: str) -> None:
    t = Table(title=title, title_justify="left")
    for header, _ in columns:
        # Ids stay whole so that they can be copied; other cells wrap.
        t.add_column(header, overflow="fold", no_wrap=header in _WHOLE)
    for row in rows:
        t.add_row(*("-" if (v := get(row)) is None else safe(str(v)) for _, get in columns))
    console.print(t)


def show(
    rows: Sequence[dict[str, Any]], columns: Sequence[Column], title: str, as_json: bool
) -> None:
    if as_json:
        print_json(list(rows))
    else:
        table(rows, columns, title)


def details(obj: dict[str, Any], as_json: bool) -> None:
    """One object: JSON, or its top-level fields as a two-column table."""
    if as_json:
        print_json(obj)
        return
    t = Table(show_header=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    for k, v in obj.items():
        if isinstance(v, (dict, list)):
            shown = json.dumps(v)
        elif k.endswith("_at") and isinstance(v, int):
            shown = when(v)
        else:
            shown = str(v)
        t.add_row(safe(str(k)), safe(shown))
    console.print(t)
