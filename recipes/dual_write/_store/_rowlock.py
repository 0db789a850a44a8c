"""The stores of databases with row locks (and SQLite's one write lock): the writer locks the row at its start.

One fencing protocol (:class:`_RowFence`: claim, touch, enter, store, each
moving ``updated_at`` strictly forward) runs over one *lock* object per
database family, which says how that database locks, creates and reads the
row (:class:`_SelectForUpdate`, :class:`_SQLiteWriteLock`,
:class:`_InnoDBLocks`).  Each public store holds a fence over its family's
locks, and its methods are the same functions over that fence;
:class:`SQLiteStore` and :class:`MySQLStore` are registered as
:class:`RowLockStore`\\ s (``isinstance`` holds, as in 1.0) without
inheriting its code.
"""

from __future__ import annotations

import math
from abc import ABCMeta
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import sqlalchemy as sa

from kafka2pc import IllegalStateError

from ._protocol import Claimed, TakenOver, _utcnow

if TYPE_CHECKING:
    from collections.abc import Callable

_R = TypeVar("_R")

__all__ = ["MySQLStore", "RowLockStore", "SQLiteStore"]

_Found = tuple[str | None, Any]
"""A locked row: ``(prepared_txn_state, updated_at)``."""


class _SelectForUpdate:
    """Any database with row locks: ``SELECT .. FOR UPDATE``, a plain ``INSERT``, MySQL's lock-timeout codes."""

    lock_error_codes: ClassVar[frozenset[int]] = frozenset({1205, 3572})  # MySQL/MariaDB: lock wait timeout, NOWAIT

    def __init__(self, table: sa.Table) -> None:
        self.table = table

    def where(self, tid: str) -> sa.ColumnElement[bool]:
        return self.table.c.transactional_id == tid

    def lock(self, conn: sa.Connection, tid: str, lock_timeout_s: float | None) -> _Found | None:
        """Lock the row; return ``(state, updated_at)``, or ``None`` if there is no row."""
        t = self.table
        row = conn.execute(
            sa.select(t.c.prepared_txn_state, t.c.updated_at).where(self.where(tid)).with_for_update()
        ).first()
        return None if row is None else (row[0], row[1])

    def create(self, conn: sa.Connection, tid: str) -> None:
        try:
            with conn.begin_nested():
                conn.execute(
                    sa.insert(self.table).values(transactional_id=tid, prepared_txn_state=None, updated_at=None)
                )
        except sa.exc.IntegrityError:
            pass  # created concurrently: the lock below waits for it

    def lock_or_create(self, conn: sa.Connection, tid: str, lock_timeout_s: float | None) -> _Found | None:
        """Lock the row, creating it first if it is missing (a claim)."""
        found = self.lock(conn, tid, lock_timeout_s)
        if found is None:
            self.create(conn, tid)
            found = self.lock(conn, tid, lock_timeout_s)
        return found

    def read_settled(self, conn: sa.Connection, tid: str, lock_timeout_s: float) -> str | None:
        found = self.lock(conn, tid, lock_timeout_s)
        return None if found is None else found[0]

    def is_lock_error(self, exc: sa.exc.DBAPIError) -> bool:
        args: tuple[Any, ...] = tuple(getattr(exc.orig, "args", ()))
        return len(args) > 0 and args[0] in self.lock_error_codes


class _SQLiteWriteLock(_SelectForUpdate):
    """SQLite: no row locks, one database write lock, taken by the first write and held until COMMIT."""

    def lock(self, conn: sa.Connection, tid: str, lock_timeout_s: float | None) -> _Found | None:
        t = self.table
        # A write (even one that changes nothing) takes the database's write lock; the
        # driver's busy timeout bounds the wait.
        conn.execute(sa.update(t).where(self.where(tid)).values(updated_at=t.c.updated_at))
        row = conn.execute(sa.select(t.c.prepared_txn_state, t.c.updated_at).where(self.where(tid))).first()
        return None if row is None else (row[0], row[1])

    def create(self, conn: sa.Connection, tid: str) -> None:
        from sqlalchemy.dialects import sqlite

        conn.execute(
            sqlite.insert(self.table)
            .values(transactional_id=tid, prepared_txn_state=None, updated_at=None)
            .on_conflict_do_nothing(index_elements=[self.table.c.transactional_id])
        )

    def read_settled(self, conn: sa.Connection, tid: str, lock_timeout_s: float) -> str | None:
        # A COMMIT in this process either happened or not: nothing to wait for, and no write lock to take.
        value: str | None = conn.execute(
            sa.select(self.table.c.prepared_txn_state).where(self.where(tid))
        ).scalar_one_or_none()
        return value

    def is_lock_error(self, exc: sa.exc.DBAPIError) -> bool:
        return "database is locked" in str(exc.orig) or "database table is locked" in str(exc.orig)


class _InnoDBLocks(_SelectForUpdate):
    """MySQL and MariaDB: the lock timeout is the session's ``innodb_lock_wait_timeout``, set around the lock."""

    @staticmethod
    def _bounded(conn: sa.Connection, lock_timeout_s: float | None, call: Callable[[], _R]) -> _R:
        if lock_timeout_s is None:
            return call()
        previous = conn.exec_driver_sql("SELECT @@SESSION.innodb_lock_wait_timeout").scalar_one()
        conn.exec_driver_sql(f"SET SESSION innodb_lock_wait_timeout = {max(1, math.ceil(lock_timeout_s))}")
        try:
            return call()
        finally:
            conn.exec_driver_sql(f"SET SESSION innodb_lock_wait_timeout = {int(previous)}")

    def lock(self, conn: sa.Connection, tid: str, lock_timeout_s: float | None) -> _Found | None:
        return self._bounded(conn, lock_timeout_s, lambda: super(_InnoDBLocks, self).lock(conn, tid, None))

    def create(self, conn: sa.Connection, tid: str) -> None:
        from sqlalchemy.dialects import mysql

        insert = mysql.insert(self.table).values(transactional_id=tid, prepared_txn_state=None, updated_at=None)
        conn.execute(insert.on_duplicate_key_update(transactional_id=insert.inserted.transactional_id))

    def lock_or_create(self, conn: sa.Connection, tid: str, lock_timeout_s: float | None) -> _Found | None:
        def create_and_lock() -> _Found | None:
            self.create(conn, tid)  # locks the row, existing or new
            return _SelectForUpdate.lock(self, conn, tid, None)

        return self._bounded(conn, lock_timeout_s, create_and_lock)


class _RowFence:
    """The fencing protocol of a row-locking store over one family's :class:`_SelectForUpdate` locks.

    The version is ``updated_at``, moved strictly forward by every write
    (``max(now, previous + 1 µs)``, re-read because a column may round it;
    a rounded-away step moves a whole second instead).
    """

    def __init__(self, locks: _SelectForUpdate) -> None:
        self.locks = locks

    def _bump(self, conn: sa.Connection, tid: str, old: Any, values: dict[str, Any]) -> str:
        """Write ``values`` and an ``updated_at`` strictly after ``old`` into the locked row; return it as a token."""
        t, where = self.locks.table, self.locks.where(tid)
        new = _utcnow()
        if isinstance(old, datetime) and new <= old:
            new = old + timedelta(microseconds=1)
        conn.execute(sa.update(t).where(where).values(**values, updated_at=new))
        stored = conn.execute(sa.select(t.c.updated_at).where(where)).scalar_one()
        if isinstance(old, datetime) and stored is not None and stored <= old:  # the column rounded our step away
            conn.execute(sa.update(t).where(where).values(updated_at=old + timedelta(seconds=1)))
            stored = conn.execute(sa.select(t.c.updated_at).where(where)).scalar_one()
        return _token(stored)

    def claim(self, conn: sa.Connection, tid: str, lock_timeout_s: float | None) -> Claimed:
        found = self.locks.lock_or_create(conn, tid, lock_timeout_s)
        if found is None:
            raise IllegalStateError(f"{tid!r}: the state row cannot be created in {self.locks.table.name}")
        state, old = found
        return Claimed(state, self._bump(conn, tid, old, {}))

    def touch(self, conn: sa.Connection, tid: str, token: str, lock_timeout_s: float | None) -> str:
        found = self.locks.lock(conn, tid, lock_timeout_s)
        if found is None or _token(found[1]) != token:
            raise TakenOver(tid)
        return self._bump(conn, tid, found[1], {})

    def store(self, conn: sa.Connection, tid: str, state: str | None, token: str, last: str | None) -> str:
        found = self.locks.lock(conn, tid, None)  # held since enter(): returns at once
        if found is None or _token(found[1]) != token or found[0] != last:
            raise TakenOver(tid)
        return self._bump(conn, tid, found[1], {"prepared_txn_state": state})

    def version(self, conn: sa.Connection, tid: str) -> str | None:
        t = self.locks.table
        row = conn.execute(sa.select(t.c.updated_at).where(self.locks.where(tid))).first()
        return None if row is None else _token(row[0])


class _Fenced(Protocol):
    """A public store: its operations are its fence's (the functions below, each store's methods)."""

    @property
    def _fence(self) -> _RowFence: ...


def _claim(self: _Fenced, conn: sa.Connection, tid: str, *, lock_timeout_s: float | None) -> Claimed:
    return self._fence.claim(conn, tid, lock_timeout_s)


def _touch(self: _Fenced, conn: sa.Connection, tid: str, token: str, *, lock_timeout_s: float | None) -> str:
    return self._fence.touch(conn, tid, token, lock_timeout_s)


def _store(self: _Fenced, conn: sa.Connection, tid: str, state: str | None, token: str, last: str | None) -> str:
    return self._fence.store(conn, tid, state, token, last)


def _no_store_and_commit(self: _Fenced, conn: sa.Connection, tid: str, state: str, token: str,
                         last: str | None) -> str:
    raise IllegalStateError(f"{type(self).__name__} has no combined state update and COMMIT")


def _read_settled(self: _Fenced, conn: sa.Connection, tid: str, *, lock_timeout_s: float) -> str | None:
    return self._fence.locks.read_settled(conn, tid, lock_timeout_s)


def _version(self: _Fenced, conn: sa.Connection, tid: str) -> str | None:
    return self._fence.version(conn, tid)


def _is_lock_error(self: _Fenced, exc: sa.exc.DBAPIError) -> bool:
    return self._fence.locks.is_lock_error(exc)


class RowLockStore(metaclass=ABCMeta):  # noqa: B024 (ABCMeta for register(): no abstract methods)
    """Any database with row locks (``SELECT .. FOR UPDATE``): the writer locks the row at its start.

    The version is ``updated_at``, moved strictly forward by every write
    (``max(now, previous + 1 µs)``, re-read because a column may round it;
    a rounded-away step moves a whole second instead).
    """

    optimistic = False
    combined_commit = False

    def __init__(self, table: sa.Table) -> None:
        self.table = table
        self._fence = _RowFence(_SelectForUpdate(table))

    claim = _claim
    touch = _touch
    enter = _touch  # the row is locked at the transaction's start: entering is a touch
    store = _store
    store_and_commit = _no_store_and_commit
    read_settled = _read_settled
    version = _version
    is_lock_error = _is_lock_error


class SQLiteStore:
    """SQLite: no row locks, one database write lock, taken by the first write and held until COMMIT."""

    optimistic = False
    combined_commit = False

    def __init__(self, table: sa.Table) -> None:
        self.table = table
        self._fence = _RowFence(_SQLiteWriteLock(table))

    claim = _claim
    touch = _touch
    enter = _touch  # the row is locked at the transaction's start: entering is a touch
    store = _store
    store_and_commit = _no_store_and_commit
    read_settled = _read_settled
    version = _version
    is_lock_error = _is_lock_error


class MySQLStore:
    """MySQL and MariaDB (InnoDB): row locks; the lock timeout is ``innodb_lock_wait_timeout`` (whole
    seconds), set for the locking statement only.  A missing row is created with ``INSERT .. ON
    DUPLICATE KEY UPDATE``, which locks it at once (a ``SELECT .. FOR UPDATE`` of a missing row
    takes a gap lock, and two claimers inserting under gap locks deadlock)."""

    optimistic = False
    combined_commit = False

    def __init__(self, table: sa.Table) -> None:
        self.table = table
        self._fence = _RowFence(_InnoDBLocks(table))

    claim = _claim
    touch = _touch
    enter = _touch  # the row is locked at the transaction's start: entering is a touch
    store = _store
    store_and_commit = _no_store_and_commit
    read_settled = _read_settled
    version = _version
    is_lock_error = _is_lock_error


RowLockStore.register(SQLiteStore)
RowLockStore.register(MySQLStore)


def _token(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.isoformat(sep=" ", timespec="microseconds")
    return str(value)
