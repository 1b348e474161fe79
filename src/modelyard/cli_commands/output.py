"""How commands print: rich tables for people, `--json` for scripts, errors as one line."""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from modelyard.cli_commands.client import ApiError
from modelyard.cli_commands.profiles import ProfileError

console = Console()
errors = Console(stderr=True)

Column = tuple[str, Callable[[dict[str, Any]], Any]]


@contextmanager
def api_errors() -> Iterator[None]:
    """An API refusal or an unusable profile: its message on stderr and exit 1, no traceback."""
    try:
        yield
    except (ApiError, ProfileError) as exc:
        errors.print(f"[red]error:[/red] {exc}", markup=True, highlight=False, soft_wrap=True)
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
        t.add_row(*("-" if (v := get(row)) is None else str(v) for _, get in columns))
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
        t.add_row(k, shown)
    console.print(t)
