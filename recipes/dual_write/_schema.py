"""The state table and the outbox table (SQLAlchemy Core, on the caller's ``MetaData``)."""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

__all__ = ["DEFAULT_OUTBOX_TABLE", "DEFAULT_STATE_TABLE", "outbox_table", "state_table"]

DEFAULT_STATE_TABLE: Final = "kafka_transaction_state"
DEFAULT_OUTBOX_TABLE: Final = "kafka_transaction_outbox"


def state_table(metadata: sa.MetaData, name: str = DEFAULT_STATE_TABLE, *, schema: str | None = None) -> sa.Table:
    """The ``transactional_id -> prepared_txn_state`` table of the KIP's "database schema prerequisite".

    Defined with SQLAlchemy Core on the caller's ``metadata`` so that
    ``metadata.create_all`` and Alembic autogenerate see it like any other
    table.  One row per transactional id; ``updated_at`` (UTC) is when a
    transaction or a recovery last wrote the row, moved strictly forward by
    every write (it is the row's version on databases other than PostgreSQL).  Calling it again with the
    same name returns the table already defined.
    """
    key = name if schema is None else f"{schema}.{name}"
    existing = metadata.tables.get(key)
    if existing is not None:
        return existing
    return sa.Table(
        name,
        metadata,
        sa.Column("transactional_id", sa.String(255), primary_key=True),
        sa.Column("prepared_txn_state", sa.String(255), nullable=True),
        # MySQL/MariaDB: microseconds (their TIMESTAMP keeps whole seconds; the column is the row's version).
        sa.Column("updated_at", sa.TIMESTAMP().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb"), nullable=True),
        schema=schema,
    )


def outbox_table(metadata: sa.MetaData, name: str = DEFAULT_OUTBOX_TABLE, *, schema: str | None = None) -> sa.Table:
    """The table where ``retain_records=True`` keeps a transaction's records until Kafka commits it.

    Each row belongs to the transaction named by ``prepared_txn_state``; only
    rows of the state stored in :func:`state_table` are ever re-published.
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


