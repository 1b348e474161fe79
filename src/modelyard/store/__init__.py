"""Persistent state: SQLAlchemy tables, Alembic migrations, repositories, the artifact store."""
