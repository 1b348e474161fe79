"""The whole schema: every table module imported, so `Base.metadata` holds every table (what
migrations are compared with and what a database is checked against)."""

from __future__ import annotations

from modelyard.store import budget_tables, people_tables
from modelyard.store.tables import Base

metadata = Base.metadata
TABLE_MODULES = (budget_tables, people_tables)  # imported for their tables
