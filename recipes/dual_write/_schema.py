"""The state table and the outbox table (SQLAlchemy Core, on the caller's ``MetaData``)."""

from __future__ import annotations

import hashlib
from typing import Final

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

__all__ = [
    "DEFAULT_OUTBOX_TABLE", "DEFAULT_STATE_TABLE", "define_outbox_table", "drop_state_function_sql",
    "state_function_sql", "define_state_table",
]

DEFAULT_STATE_TABLE: Final = "kafka_transaction_state"
DEFAULT_OUTBOX_TABLE: Final = "kafka_transaction_outbox"


def define_state_table(
    metadata: sa.MetaData, name: str = DEFAULT_STATE_TABLE, *, schema: str | None = None
) -> sa.Table:
    """The ``transactional_id -> prepared_txn_state`` table of the KIP's "database schema prerequisite".

    Defined with SQLAlchemy Core on the caller's ``metadata`` so that
    ``metadata.create_all`` and Alembic autogenerate see it like any other
    table.  One row per transactional id; ``updated_at`` (UTC) is when a
    transaction or a recovery last wrote the row, moved strictly forward by
    every write (it is the row's version on databases other than PostgreSQL).  Calling it again with the
    same name returns the table already defined.

    On PostgreSQL, creating the table (``metadata.create_all``,
    ``table.create``) also creates its state function
    (:func:`state_function_sql`), which makes the state update cheaper.
    """
    key = name if schema is None else f"{schema}.{name}"
    existing = metadata.tables.get(key)
    if existing is not None:
        return existing
    table = sa.Table(
        name,
        metadata,
        sa.Column("transactional_id", sa.String(255), primary_key=True),
        sa.Column("prepared_txn_state", sa.String(255), nullable=True),
        # MySQL/MariaDB: microseconds (their TIMESTAMP keeps whole seconds; the column is the row's version).
        sa.Column("updated_at", sa.TIMESTAMP().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb"), nullable=True),
        schema=schema,
    )
    create = sa.DDL(state_function_sql(table))  # type: ignore[no-untyped-call]
    drop = sa.DDL(drop_state_function_sql(table))  # type: ignore[no-untyped-call]
    sa.event.listen(table, "after_create", create.execute_if(dialect="postgresql"))
    sa.event.listen(table, "before_drop", drop.execute_if(dialect="postgresql"))
    return table


_STATE_FUNCTION_ARGS: Final = "text, text, text, text, timestamp"
_ROW_CHANGED: Final = "kafka2pc: the state row changed (another writer took over the transactional id)"
"""The error message of a guarded state update that found the row changed (the stores match on it)."""


def state_function_name(table: sa.Table) -> str:
    """The name of ``table``'s state function (in the table's schema): at most 63 characters."""
    name = f"kafka2pc_store_{table.name}"
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(f"{table.schema}.{table.name}".encode()).hexdigest()[:10]
    return f"{name[:52]}_{digest}"


def _quote_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _qualified(name: str, schema: str | None) -> str:
    return _quote_identifier(name) if schema is None else f"{_quote_identifier(schema)}.{_quote_identifier(name)}"


def drop_state_function_sql(table: sa.Table) -> str:
    """PostgreSQL's ``DROP FUNCTION IF EXISTS`` of ``table``'s state function (:func:`state_function_sql`)."""
    return f"DROP FUNCTION IF EXISTS {_qualified(state_function_name(table), table.schema)}({_STATE_FUNCTION_ARGS})"


def state_function_sql(table: sa.Table) -> str:
    """PostgreSQL's ``CREATE OR REPLACE FUNCTION`` statement of ``table``'s state function.

    The function is the writer's guarded state update: it stores a prepared
    state iff the row still carries the writer's version (``xmin``) and the
    state it last stored, and returns the row's new version; a changed row
    raises (``22P02``), which rolls the transaction back.  PostgreSQL plans
    it once per session, where the same update sent as text is parsed and
    planned with every commit.  ``metadata.create_all`` creates it with the
    table and :meth:`DualWriter.create_tables` on an existing table; with
    migrations, run this statement once (a writer without it uses the
    inline update, at about twice the database CPU per transaction).
    """
    target = _qualified(table.name, table.schema)
    function = _qualified(state_function_name(table), table.schema)
    message = _ROW_CHANGED.replace("'", "''")
    return (
        f"CREATE OR REPLACE FUNCTION {function}"
        "(p_tid text, p_state text, p_token text, p_last text, p_now timestamp) "
        "RETURNS bigint LANGUAGE plpgsql AS $kafka2pc$\n"
        "DECLARE v text;\n"
        "BEGIN\n"
        f"  UPDATE {target} SET prepared_txn_state = p_state, updated_at = p_now\n"
        "   WHERE transactional_id = p_tid AND xmin = p_token::xid\n"
        "     AND prepared_txn_state IS NOT DISTINCT FROM p_last\n"
        "  RETURNING xmin::text INTO v;\n"
        f"  IF v IS NULL THEN RAISE EXCEPTION USING ERRCODE = '22P02', MESSAGE = '{message}'; END IF;\n"
        "  RETURN v::bigint;\n"
        "END\n"
        "$kafka2pc$"
    )


def create_state_table(bind: sa.Engine | sa.Connection, table: sa.Table) -> None:
    """Create ``table`` if missing and, on PostgreSQL, (re)create its state function (existing tables too)."""
    table.create(bind, checkfirst=True)
    if bind.dialect.name != "postgresql":
        return
    if isinstance(bind, sa.Engine):
        with bind.begin() as conn:
            conn.exec_driver_sql(state_function_sql(table))
    else:
        bind.exec_driver_sql(state_function_sql(table))


def define_outbox_table(
    metadata: sa.MetaData, name: str = DEFAULT_OUTBOX_TABLE, *, schema: str | None = None
) -> sa.Table:
    """The table where ``retain_records=True`` keeps a transaction's records until Kafka commits it.

    Each row belongs to the transaction named by ``prepared_txn_state``; only
    rows of the state stored in :func:`define_state_table` are ever re-published.
    ``kafka_partition`` is the partition the record was delivered to, so a
    re-published record lands where the original would have.
    """
    key = name if schema is None else f"{schema}.{name}"
    existing = metadata.tables.get(key)
    if existing is not None:
        return existing
    return sa.Table(
        name,
        metadata,
        sa.Column("transactional_id", sa.String(255), primary_key=True),
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("prepared_txn_state", sa.String(255), nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("kafka_partition", sa.Integer(), nullable=True),
        sa.Column("record_key", sa.LargeBinary(), nullable=True),
        sa.Column("record_value", sa.LargeBinary(), nullable=True),
        sa.Column("headers", sa.Text(), nullable=True),
        schema=schema,
    )


