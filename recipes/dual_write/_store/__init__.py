"""The state row's fencing protocol, once per database family, behind one :class:`StateStore` protocol.

Every writer of a transactional id's state row (a :class:`DualWriter`'s
transaction, its recovery, ``kafka2pc recover``) goes through a store, so the
rules live here and nowhere else:

* The row has a **version** (the *token*): PostgreSQL's ``xmin`` (the
  transaction that wrote the row version), elsewhere ``updated_at``, which
  every write moves strictly forward.
* A **claim** (recovery, the CLI) locks the row, reads the stored state and
  gives the row a new version; the caller COMMITs the claim *before* it
  touches Kafka.  From that COMMIT on, every token handed out earlier is void.
* A writer's database transaction stores its state only if the row still
  carries the token it got from its own last commit (or claim), in the same
  database transaction as its data.  A writer that was taken over therefore
  can never commit its database side after the new owner settled Kafka: the
  new owner's claim committed first, whatever dies when.

PostgreSQL checks optimistically (nothing is locked before the guarded state
update, ``READ COMMITTED`` re-reads a row another transaction changed while
the update waited for its lock).  SQLite has a single write lock and other
databases row locks: there the writer locks the row and checks the token at
the start of its transaction (:meth:`StateStore.enter`) and keeps the lock
until its COMMIT.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._postgres import PostgresStore
from ._protocol import Claimed, StateStore, TakenOver, locked
from ._rowlock import MySQLStore, RowLockStore, SQLiteStore

if TYPE_CHECKING:
    import sqlalchemy as sa

__all__ = [
    "Claimed",
    "MySQLStore",
    "PostgresStore",
    "RowLockStore",
    "SQLiteStore",
    "StateStore",
    "TakenOver",
    "locked",
    "store_for",
]


def store_for(dialect: sa.Dialect, table: sa.Table) -> StateStore:
    """The store of ``dialect``'s database family (the one place that looks at the dialect's name)."""
    if dialect.name == "postgresql":
        return PostgresStore(table, dialect.driver)
    if dialect.name == "sqlite":
        return SQLiteStore(table)
    if dialect.name in ("mysql", "mariadb"):
        return MySQLStore(table)
    return RowLockStore(table)
