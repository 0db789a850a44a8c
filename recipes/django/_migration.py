"""The migration's one database operation: the dual write's tables, with the DDL SQLAlchemy emits.

A custom operation rather than ``RunPython``, so that ``manage.py sqlmigrate kafka2pc 0001`` prints the
SQL a DBA reviews (``RunPython`` prints only "Raw Python operation").  Forwards, each table the
SQLAlchemy recipe would create is created unless it exists (a database both recipes use), and on
PostgreSQL the state function is (re)created.  Backwards, a table is dropped only if it holds no row
of another writer: a SQLAlchemy service that shares the tables keeps them, and its rows.  The DDL,
the state function and its drop all come from :mod:`kafka2pc.recipes.dual_write`; nothing is named here.
"""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa
from django.db.migrations.operations.base import Operation

__all__ = ["CreateRecipeTables"]

logger = logging.getLogger("kafka2pc.recipes.django")


def _tables() -> list[sa.Table]:
    from ..dual_write import define_lease_table, define_outbox_table, define_state_table

    metadata = sa.MetaData()
    return [define_state_table(metadata), define_lease_table(metadata), define_outbox_table(metadata)]


def _dialect(schema_editor: Any) -> sa.Dialect:
    from ._engines import dialect_url

    return sa.create_engine(dialect_url(schema_editor.connection)).dialect


def _existing(schema_editor: Any) -> set[str]:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        return set(connection.introspection.table_names(cursor))


def _ours(transactional_id: str, prefix: str | None) -> bool:
    """Whether a row's transactional id belongs to one of the app's pools (``prefix`` or ``prefix.<alias>``)."""
    return prefix is not None and transactional_id.startswith((f"{prefix}-", f"{prefix}."))


def _app_prefix() -> str | None:
    from ._settings import ConfigurationError, current_settings

    try:
        return current_settings().prefix
    except ConfigurationError:
        return None


class CreateRecipeTables(Operation):
    """Create the state, lease and outbox tables unless they exist; backwards, drop those only the app uses."""

    reversible = True
    reduces_to_sql = True
    atomic = True

    def state_forwards(self, app_label: str, state: Any) -> None:
        """Nothing: the models' state comes from the migration's ``state_operations``."""

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        """``CREATE TABLE`` and ``CREATE INDEX`` for each missing table; the state function on PostgreSQL."""
        from sqlalchemy.schema import CreateIndex, CreateTable

        from ..dual_write import state_function_sql

        dialect = _dialect(schema_editor)
        # sqlmigrate (collect_sql) shows every statement; a migration creates only what is missing.
        existing = set() if schema_editor.collect_sql else _existing(schema_editor)
        for table in _tables():
            if table.name not in existing:
                schema_editor.execute(str(CreateTable(table).compile(dialect=dialect)), params=None)
                for index in sorted(table.indexes, key=lambda i: str(i.name)):
                    schema_editor.execute(str(CreateIndex(index).compile(dialect=dialect)), params=None)
            if table.name == _tables()[0].name and dialect.name == "postgresql":
                schema_editor.execute(state_function_sql(table), params=None)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        """``DROP TABLE`` for each table holding no row of another writer (and the state function with its table)."""
        from ..dual_write import drop_state_function_sql

        dialect = _dialect(schema_editor)
        quote = dialect.identifier_preparer.quote
        prefix = _app_prefix()
        existing = None if schema_editor.collect_sql else _existing(schema_editor)
        for table in reversed(_tables()):
            if existing is not None:
                if table.name not in existing:
                    continue
                foreign = self._foreign_rows(schema_editor, table, quote, prefix)
                if foreign:
                    logger.warning("kafka2pc: table %s kept: %d row(s) belong to other writers (a SQLAlchemy "
                                   "service?), not to the pools %r", table.name, foreign, prefix)
                    continue
            if table.name == _tables()[0].name and dialect.name == "postgresql":
                schema_editor.execute(drop_state_function_sql(table), params=None)
            schema_editor.execute(f"DROP TABLE {quote(table.name)}", params=None)

    @staticmethod
    def _foreign_rows(schema_editor: Any, table: sa.Table, quote: Any, prefix: str | None) -> int:
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(f"SELECT DISTINCT transactional_id FROM {quote(table.name)}")
            return sum(not _ours(str(row[0]), prefix) for row in cursor.fetchall())

    def describe(self) -> str:
        """What ``migrate`` and ``sqlmigrate`` say about the operation."""
        return ("Create the dual write's tables (kafka_transaction_state, kafka_writer_lease, "
                "kafka_transaction_outbox) unless they exist; reversed, drop those holding only the app's rows")

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        """The operation as the migration file writes it."""
        return "kafka2pc.recipes.django._migration.CreateRecipeTables", [], {}
