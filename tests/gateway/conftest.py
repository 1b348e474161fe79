"""Fixtures the gateway's tests share: a migrated SQLite database of their own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from modelyard.store.db import Database, sqlite_url


@pytest.fixture()
def database(tmp_path: Path) -> Iterator[Database]:
    """A fresh, migrated SQLite database in the test's own directory."""
    db = Database(sqlite_url(tmp_path / "gateway.db"))
    db.migrate()
    try:
        yield db
    finally:
        db.dispose()
