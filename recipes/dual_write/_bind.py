"""The Session or Connection a transaction runs on, guarded against commits, rollbacks and closes in the block.

The database transaction of :meth:`DualWriter.transaction` belongs to the
recipe: only it may end it, together with the Kafka transaction.  Service
code that commits "internally" inside the block would otherwise commit the
rows while the recipe aborts the Kafka records.  The guard listens to the
Connection's ``commit`` and ``rollback`` events (a Session's commit, rollback
and close end up there too; savepoints fire other events and stay allowed):

* a commit is refused: the database transaction is rolled back right away
  (through the driver, before SQLAlchemy sends the COMMIT) and
  :class:`TransactionMisuseError` is raised from ``commit()``;
* a rollback (or close) is let through (it may be SQLAlchemy's own reaction
  to a failed flush) and remembered; when nothing else is failing it raises
  :class:`TransactionMisuseError` after rolling back.

Either way the block fails with that error and the Kafka transaction is
aborted: neither side keeps anything.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session

from kafka2pc import UsageError

from ._values import TransactionMisuseError

__all__ = ["Bind", "Bound", "bind"]

logger = logging.getLogger(__name__)

Bind = Session | sa.Connection
"""What :meth:`DualWriter.transaction` runs on: an ORM Session or a Core Connection."""


@dataclass
class Bound:
    """A Session or Connection seen through the operations the recipe needs, with the misuse guard."""

    connection: sa.Connection
    flush: Callable[[], None]
    _commit: Callable[[], None]
    _rollback: Callable[[], None]
    session: bool
    """True for a Session: its ``commit()`` may run hooks that write, so it must send the COMMIT itself."""
    transactional_id: str
    misuse: str | None = None
    """``"commit"``, ``"rollback"``: what the application did to the bound transaction in the block."""
    misuse_while_failing: bool = False
    """The rollback happened while an exception was being handled (e.g. SQLAlchemy's own rollback
    after a failed flush): that exception, not the misuse, is the one to report."""
    _ours: bool = field(default=False)
    _installed: bool = field(default=False)

    def install(self) -> None:
        """Start guarding the bound transaction."""
        event.listen(self.connection, "commit", self._on_commit)
        event.listen(self.connection, "rollback", self._on_rollback)
        self._installed = True

    def remove(self) -> None:
        """Stop guarding (at the end of the block, whatever happened)."""
        if self._installed:
            self._installed = False
            event.remove(self.connection, "commit", self._on_commit)
            event.remove(self.connection, "rollback", self._on_rollback)

    def commit(self) -> None:
        """The recipe's own COMMIT."""
        self._ours = True
        try:
            self._commit()
        finally:
            self._ours = False

    def rollback(self) -> None:
        """The recipe's own ROLLBACK."""
        self._ours = True
        try:
            self._rollback()
        finally:
            self._ours = False
        if self.session and self.misuse is not None and not self.connection.closed:
            # The guard interrupted the Session's own rollback or close half-way: the Session has
            # let go of its connection without returning it to the pool.
            self.connection.close()

    def misuse_error(self) -> TransactionMisuseError:
        """The error that tells what the application did."""
        verb = {"commit": "committed", "rollback": "rolled back (or closed)"}.get(self.misuse or "", "ended")
        return TransactionMisuseError(
            f"{self.transactional_id!r}: the application {verb} the database transaction inside "
            "`with writer.transaction(...)`: the recipe commits it together with the Kafka transaction. "
            "Both sides were rolled back (nothing of this transaction is kept); write without commit() "
            "or rollback() in the block (savepoints with begin_nested() are fine)"
        )

    def _raw_rollback(self) -> None:
        # The DBAPI connection (for an async driver, SQLAlchemy's sync adapter of it), not the driver's own.
        driver = self.connection.connection.dbapi_connection if not self.connection.closed else None
        if driver is not None:
            try:
                driver.rollback()
            except Exception:  # a dead connection rolls back by itself
                logger.debug("%s: rollback after a refused commit failed", self.transactional_id, exc_info=True)

    def _on_commit(self, conn: sa.Connection) -> None:
        if self._ours:
            return
        self.misuse = "commit"
        self._raw_rollback()  # SQLAlchemy ends its Transaction object whatever happens: leave no open one
        raise self.misuse_error()

    def _on_rollback(self, conn: sa.Connection) -> None:
        if self._ours or self.misuse is not None:
            return
        self.misuse = "rollback"
        self.misuse_while_failing = sys.exc_info()[1] is not None
        if not self.misuse_while_failing:  # not SQLAlchemy's own rollback after a failed flush
            self._raw_rollback()
            raise self.misuse_error()


def bind(target: Bind, transactional_id: str) -> Bound:
    """The :class:`Bound` of a Session (its connection, flushed before the prepare) or a Connection."""
    if isinstance(target, Session):
        return Bound(target.connection(), target.flush, target.commit, target.rollback, True, transactional_id)
    if isinstance(target, sa.Connection):
        if not target.in_transaction():
            target.begin()
        return Bound(target, lambda: None, target.commit, target.rollback, False, transactional_id)
    raise UsageError(f"transaction() takes a SQLAlchemy Session or Connection, not {type(target).__name__}")
