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
import threading
import weakref
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
    orm: Session | None = None
    """The Session, for a Session (see :meth:`commits_alone`)."""
    _ours: bool = field(default=False)
    _installed: bool = field(default=False)

    def commits_alone(self) -> bool:
        """True when a COMMIT the recipe sends on :attr:`connection` is all :meth:`commit` would commit.

        Always for a Connection.  For a Session (after :attr:`flush`), when its
        ``commit()`` would write nothing more and end only this transaction: no
        ``before_commit`` listener, nothing left to flush, not two-phase, and
        bound to an Engine (a Session joined to a Connection's transaction does
        not commit it).  Then the state update can go with the COMMIT in one
        round trip, and ``commit()`` afterwards is the Session's bookkeeping.
        """
        session = self.orm
        if session is None:
            return True
        return (not session.twophase and not session.dispatch.before_commit
                and isinstance(session.get_bind(), sa.Engine)
                and not session.new and not session.deleted and not session.dirty)

    def install(self) -> None:
        """Start guarding the bound transaction."""
        _listen_once(self.connection.engine)
        _active[id(self.connection)] = self
        self._installed = True

    def remove(self) -> None:
        """Stop guarding (at the end of the block, whatever happened)."""
        if self._installed:
            self._installed = False
            if _active.get(id(self.connection)) is self:
                del _active[id(self.connection)]

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


_active: dict[int, Bound] = {}
"""The guarded Connections (by ``id``) and their :class:`Bound`, while their blocks run."""
_listening: weakref.WeakSet[sa.Engine] = weakref.WeakSet()
_listening_lock = threading.Lock()


def _listen_once(engine: sa.Engine) -> None:
    """Listen to ``engine``'s commits and rollbacks, once per Engine.

    One listener pair per Engine, looking the Connection up in :data:`_active`,
    instead of a pair added to and removed from each Connection per
    transaction: SQLAlchemy's event registry made that a tenth of the
    recipe's CPU time per transaction.  Connections read their Engine's
    listeners when an event fires, so Connections opened earlier are covered.
    """
    if engine in _listening:
        return
    with _listening_lock:
        if engine not in _listening:
            event.listen(engine, "commit", _on_commit)
            event.listen(engine, "rollback", _on_rollback)
            _listening.add(engine)


def _guard_of(conn: sa.Connection) -> Bound | None:
    bound = _active.get(id(conn))
    return bound if bound is not None and bound.connection is conn else None


def _on_commit(conn: sa.Connection) -> None:
    bound = _guard_of(conn)
    if bound is not None:
        bound._on_commit(conn)


def _on_rollback(conn: sa.Connection) -> None:
    bound = _guard_of(conn)
    if bound is not None:
        bound._on_rollback(conn)


def bind(target: Bind, transactional_id: str) -> Bound:
    """The :class:`Bound` of a Session (its connection, flushed before the prepare) or a Connection."""
    if isinstance(target, Session):
        return Bound(target.connection(), target.flush, target.commit, target.rollback, True, transactional_id,
                     orm=target)
    if isinstance(target, sa.Connection):
        if not target.in_transaction():
            target.begin()
        return Bound(target, lambda: None, target.commit, target.rollback, False, transactional_id)
    raise UsageError(f"transaction() takes a SQLAlchemy Session or Connection, not {type(target).__name__}")
