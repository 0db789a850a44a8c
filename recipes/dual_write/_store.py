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

import logging
import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, ClassVar, Final, Protocol, TypeVar

import sqlalchemy as sa

from kafka2pc import IllegalStateError

from ._schema import _ROW_CHANGED, _STATE_FUNCTION_ARGS, _qualified, state_function_name
from ._values import StateRowLockedError

if TYPE_CHECKING:
    from collections.abc import Callable

_R = TypeVar("_R")

__all__ = ["MySQLStore", "PostgresStore", "RowLockStore", "SQLiteStore", "StateStore", "TakenOver", "store_for"]

logger = logging.getLogger(__name__)

# PostgreSQL's system column naming the transaction that wrote a row version: the
# state row's optimistic concurrency token (compared as text, 32-bit xid: a false
# match needs 2**32 transactions between a writer's two commits *and* a hit).
_XMIN: Final[sa.ColumnClause[str]] = sa.literal_column("CAST(xmin AS text)")


class TakenOver(Exception):
    """The state row no longer carries the caller's token: another instance claimed the id."""


@dataclass(frozen=True)
class Claimed:
    """What a claim found: the stored state (``None``: empty) and the row's new token."""

    state: str | None
    token: str


def _utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def _pg_literal(value: str | datetime | None) -> str:
    """``value`` as a PostgreSQL literal, for a session with ``standard_conforming_strings`` on.

    There a string literal is taken verbatim between its quotes, with a
    quote doubled; backslashes mean nothing.  NUL, which PostgreSQL's text
    cannot hold, is refused rather than sent.
    """
    if value is None:
        return "NULL"
    text = value.isoformat(" ") if isinstance(value, datetime) else value
    if "\0" in text:
        raise ValueError(f"a PostgreSQL text value cannot hold NUL: {text!r}")
    return "'" + text.replace("'", "''") + "'"


class StateStore(Protocol):
    """How one database family locks, versions and writes a state row.  All methods run in the
    caller's database transaction on ``conn``; none commits (except :meth:`store_and_commit`)."""

    table: sa.Table
    optimistic: bool
    """True when :meth:`enter` locks nothing (the check happens in :meth:`store`)."""
    combined_commit: bool
    """True when :meth:`store_and_commit` can send the state update and the COMMIT in one round trip."""

    def claim(self, conn: sa.Connection, tid: str, *, lock_timeout_s: float | None) -> Claimed:
        """Lock the row (creating it if missing), read its state and give it a new version."""

    def touch(self, conn: sa.Connection, tid: str, token: str, *, lock_timeout_s: float | None) -> str:
        """Lock the row iff it still carries ``token`` and give it a new version; raise :class:`TakenOver`."""

    def enter(self, conn: sa.Connection, tid: str, token: str, *, lock_timeout_s: float | None) -> str:
        """Start a writer's transaction: check ``token`` (and lock the row) unless :attr:`optimistic`."""

    def store(self, conn: sa.Connection, tid: str, state: str | None, token: str, last: str | None) -> str:
        """Write ``state`` iff the row still carries ``token`` (and ``last``); return the new token."""

    def store_and_commit(self, conn: sa.Connection, tid: str, state: str, token: str, last: str | None) -> str:
        """:meth:`store` and COMMIT in one round trip (only if :attr:`combined_commit`)."""

    def read_settled(self, conn: sa.Connection, tid: str, *, lock_timeout_s: float) -> str | None:
        """The stored state, read after any unfinished transaction on the row ended."""

    def version(self, conn: sa.Connection, tid: str) -> str | None:
        """The row's current token, without locking (``None``: no row)."""

    def is_lock_error(self, exc: sa.exc.DBAPIError) -> bool:
        """True when ``exc`` means the row (or database) lock could not be had in time."""


def locked(store: StateStore, tid: str, action: str, call: Callable[[], Any]) -> Any:
    """Run ``call``; turn the database's lock-timeout error into :class:`StateRowLockedError`."""
    try:
        return call()
    except sa.exc.DBAPIError as exc:
        if store.is_lock_error(exc):
            raise StateRowLockedError.wrap(exc, tid, action) from exc
        raise


def _execute_scalar(conn: sa.Connection, statement: str) -> Any:
    """Run a parameterless ``statement`` on ``conn``; return the first column of its first row.

    What ``conn.exec_driver_sql(statement, execution_options={"no_parameters":
    True}).scalar_one()`` does, without SQLAlchemy's execution context and
    result objects when no listener watches statements on the engine: errors
    still arrive as ``sqlalchemy.exc.DBAPIError`` and a dead connection is
    still invalidated.  With ``before_cursor_execute``, ``after_cursor_execute``
    or ``handle_error`` listeners (tracing, statement logs) it goes through
    SQLAlchemy, so that they see it.
    """
    dispatch, dialect = conn.dispatch, conn.dialect
    if dispatch.before_cursor_execute or dispatch.after_cursor_execute or dialect.dispatch.handle_error:
        return conn.exec_driver_sql(statement, execution_options={"no_parameters": True}).scalar_one()
    dbapi_conn = conn.connection.dbapi_connection
    if dbapi_conn is None:
        raise sa.exc.ResourceClosedError("This Connection is closed")
    cursor = dbapi_conn.cursor()
    try:
        cursor.execute(statement)
        row = cursor.fetchone()
    except dialect.loaded_dbapi.Error as exc:
        disconnect = dialect.is_disconnect(exc, dbapi_conn, cursor)
        error = sa.exc.DBAPIError.instance(
            statement, None, exc, dialect.loaded_dbapi.Error, connection_invalidated=disconnect, dialect=dialect
        )
        if disconnect:
            conn.invalidate(error)
        raise error from exc
    finally:
        cursor.close()
    if row is None:
        raise sa.exc.NoResultFound("No row was found when one was required")
    return row[0]


class PostgresStore:
    """PostgreSQL: ``xmin`` is the version; the writer checks optimistically in its guarded update."""

    optimistic = True
    combined_commit: bool

    def __init__(self, table: sa.Table, driver: str) -> None:
        self.table = table
        # psycopg 3 with the simple query protocol sends two statements in one round trip.
        self.combined_commit = driver == "psycopg"
        self._combined_template: str | None = None
        self._function_template: str | None = None
        """The call of the state function, once a claim found it (see ``state_function_sql``)."""
        self._function_checked = False

    def _where(self, tid: str) -> sa.ColumnElement[bool]:
        return self.table.c.transactional_id == tid

    @staticmethod
    def _lock_timeout(conn: sa.Connection, lock_timeout_s: float | None) -> None:
        if lock_timeout_s is not None:
            conn.exec_driver_sql(f"SET LOCAL lock_timeout = {max(1, round(lock_timeout_s * 1000))}")

    def claim(self, conn: sa.Connection, tid: str, *, lock_timeout_s: float | None) -> Claimed:
        from sqlalchemy.dialects import postgresql

        self._lock_timeout(conn, lock_timeout_s)
        if self.combined_commit:
            self._find_function(conn)
        t = self.table
        row = conn.execute(
            sa.update(t).where(self._where(tid)).values(updated_at=_utcnow()).returning(t.c.prepared_txn_state, _XMIN)
        ).first()
        if row is None:
            insert = postgresql.insert(t).values(transactional_id=tid, prepared_txn_state=None, updated_at=_utcnow())
            row = conn.execute(
                insert.on_conflict_do_update(
                    index_elements=[t.c.transactional_id], set_={"updated_at": insert.excluded.updated_at}
                ).returning(t.c.prepared_txn_state, _XMIN)
            ).one()
        return Claimed(row[0], str(row[1]))

    def _find_function(self, conn: sa.Connection) -> None:
        """Use the table's state function if the database has it (checked at every claim: cheap)."""
        t = self.table
        name = _qualified(state_function_name(t), t.schema)
        found = conn.execute(
            sa.text("SELECT to_regprocedure(:signature) IS NOT NULL"),
            {"signature": f"{name}({_STATE_FUNCTION_ARGS})"},
        ).scalar_one()
        if not found and not self._function_checked:
            logger.info("%s has no state function %s: the state update is sent inline (create it with "
                        "DualWriter.create_tables() or state_function_sql())", t.fullname, name)
        braced = name.replace("{", "{{").replace("}", "}}")
        self._function_template = f"SELECT {braced}({{tid}}, {{state}}, {{token}}, {{last}}, {{now}}); COMMIT" \
            if found else None
        self._function_checked = True

    def touch(self, conn: sa.Connection, tid: str, token: str, *, lock_timeout_s: float | None) -> str:
        self._lock_timeout(conn, lock_timeout_s)
        guarded = sa.and_(self._where(tid), sa.text("xmin = CAST(:k2pc_token AS xid)").bindparams(k2pc_token=token))
        new = conn.execute(
            sa.update(self.table).where(guarded).values(updated_at=_utcnow()).returning(_XMIN)
        ).scalar_one_or_none()
        if new is None:
            raise TakenOver(tid)
        return str(new)

    def enter(self, conn: sa.Connection, tid: str, token: str, *, lock_timeout_s: float | None) -> str:
        return token  # optimistic: store() checks

    def store(self, conn: sa.Connection, tid: str, state: str | None, token: str, last: str | None) -> str:
        t = self.table
        guarded = sa.and_(
            self._where(tid),
            sa.text("xmin = CAST(:k2pc_token AS xid)").bindparams(k2pc_token=token),
            t.c.prepared_txn_state.is_not_distinct_from(last),
        )
        new = conn.execute(
            sa.update(t).where(guarded).values(prepared_txn_state=state, updated_at=_utcnow()).returning(_XMIN)
        ).scalar_one_or_none()
        if new is None:
            raise TakenOver(tid)
        return str(new)

    def store_and_commit(self, conn: sa.Connection, tid: str, state: str, token: str, last: str | None) -> str:
        """:meth:`store`'s guarded update and ``COMMIT`` in one statement text, one round trip.

        Sent without parameters (see :func:`_execute_scalar`), so psycopg
        uses the simple query protocol (values quoted here, as psycopg would), which
        allows two statements: PostgreSQL runs them in order and skips the
        ``COMMIT`` if the update fails.  A changed row fails the update with
        ``22P02`` naming the reason, on purpose: the transaction then rolls
        back instead of committing without its state.  The update is the
        table's state function when the last claim found it (planned once per
        session), else the same update inline (parsed and planned each time),
        whose result then fails a cast.
        """
        import psycopg
        from psycopg import sql

        driver = conn.connection.driver_connection
        if driver is None:
            raise IllegalStateError(f"{tid!r}: the database connection is closed")
        if self._function_template is not None:
            template = self._function_template
        elif self._combined_template is None:  # the table's name quoted once; the values quoted per call
            t = self.table
            name = sql.Identifier(t.schema, t.name) if t.schema else sql.Identifier(t.name)
            table = name.as_string(driver).replace("{", "{{").replace("}", "}}")
            template = self._combined_template = (
                f"WITH u AS (UPDATE {table} SET prepared_txn_state = {{state}}, updated_at = {{now}} "
                "WHERE transactional_id = {tid} AND xmin = {token}::xid "
                "AND prepared_txn_state IS NOT DISTINCT FROM {last}::text RETURNING xmin::text AS t) "
                f"SELECT CAST(COALESCE((SELECT t FROM u), {sql.Literal(_ROW_CHANGED).as_string(driver)}) AS bigint); "
                "COMMIT"
            )
        else:
            template = self._combined_template

        if driver.info.parameter_status("standard_conforming_strings") == "on":
            quoted: Callable[[str | datetime | None], str] = _pg_literal
        else:
            def quoted(value: str | datetime | None) -> str:
                return sql.Literal(value).as_string(driver)

        statement = template.format(
            state=quoted(state), now=quoted(_utcnow()), tid=quoted(tid), token=quoted(token), last=quoted(last)
        )
        try:
            new = _execute_scalar(conn, statement)
        except sa.exc.DBAPIError as exc:
            if isinstance(exc.orig, psycopg.errors.InvalidTextRepresentation) and _ROW_CHANGED in str(exc.orig):
                raise TakenOver(tid) from exc
            if isinstance(exc.orig, psycopg.errors.UndefinedFunction) and template is self._function_template:
                # Dropped since the last claim: this transaction rolls back; the next ones update inline.
                logger.warning("%s: the state function is gone (%s); the state update is sent inline from now on",
                               tid, exc.orig)
                self._function_template = None
            raise
        return str(new)

    def read_settled(self, conn: sa.Connection, tid: str, *, lock_timeout_s: float) -> str | None:
        # FOR UPDATE waits (bounded) for the row lock: a COMMIT still running on a dying connection ends first.
        self._lock_timeout(conn, lock_timeout_s)
        stmt = sa.select(self.table.c.prepared_txn_state).where(self._where(tid)).with_for_update()
        value: str | None = conn.execute(stmt).scalar_one_or_none()
        return value

    def version(self, conn: sa.Connection, tid: str) -> str | None:
        value = conn.execute(sa.select(_XMIN).select_from(self.table).where(self._where(tid))).scalar_one_or_none()
        return None if value is None else str(value)

    def is_lock_error(self, exc: sa.exc.DBAPIError) -> bool:
        return getattr(exc.orig, "sqlstate", None) == "55P03"  # lock_not_available


class RowLockStore:
    """Any database with row locks (``SELECT .. FOR UPDATE``): the writer locks the row at its start.

    The version is ``updated_at``, moved strictly forward by every write
    (``max(now, previous + 1 µs)``, re-read because a column may round it;
    a rounded-away step moves a whole second instead).
    """

    optimistic = False
    combined_commit = False
    lock_error_codes: ClassVar[frozenset[int]] = frozenset({1205, 3572})  # MySQL/MariaDB: lock wait timeout, NOWAIT

    def __init__(self, table: sa.Table) -> None:
        self.table = table

    def _where(self, tid: str) -> sa.ColumnElement[bool]:
        return self.table.c.transactional_id == tid

    def _lock(self, conn: sa.Connection, tid: str, lock_timeout_s: float | None) -> tuple[str | None, Any] | None:
        """Lock the row; return ``(state, updated_at)``, or ``None`` if there is no row."""
        t = self.table
        row = conn.execute(
            sa.select(t.c.prepared_txn_state, t.c.updated_at).where(self._where(tid)).with_for_update()
        ).first()
        return None if row is None else (row[0], row[1])

    def _create(self, conn: sa.Connection, tid: str) -> None:
        try:
            with conn.begin_nested():
                conn.execute(
                    sa.insert(self.table).values(transactional_id=tid, prepared_txn_state=None, updated_at=None)
                )
        except sa.exc.IntegrityError:
            pass  # created concurrently: the lock below waits for it

    def _bump(self, conn: sa.Connection, tid: str, old: Any, values: dict[str, Any]) -> str:
        """Write ``values`` and an ``updated_at`` strictly after ``old`` into the locked row; return it as a token."""
        t = self.table
        new = _utcnow()
        if isinstance(old, datetime) and new <= old:
            new = old + timedelta(microseconds=1)
        conn.execute(sa.update(t).where(self._where(tid)).values(**values, updated_at=new))
        stored = conn.execute(sa.select(t.c.updated_at).where(self._where(tid))).scalar_one()
        if isinstance(old, datetime) and stored is not None and stored <= old:  # the column rounded our step away
            conn.execute(sa.update(t).where(self._where(tid)).values(updated_at=old + timedelta(seconds=1)))
            stored = conn.execute(sa.select(t.c.updated_at).where(self._where(tid))).scalar_one()
        return _token(stored)

    def claim(self, conn: sa.Connection, tid: str, *, lock_timeout_s: float | None) -> Claimed:
        found = self._lock(conn, tid, lock_timeout_s)
        if found is None:
            self._create(conn, tid)
            found = self._lock(conn, tid, lock_timeout_s)
            if found is None:
                raise IllegalStateError(f"{tid!r}: the state row cannot be created in {self.table.name}")
        state, old = found
        return Claimed(state, self._bump(conn, tid, old, {}))

    def touch(self, conn: sa.Connection, tid: str, token: str, *, lock_timeout_s: float | None) -> str:
        found = self._lock(conn, tid, lock_timeout_s)
        if found is None or _token(found[1]) != token:
            raise TakenOver(tid)
        return self._bump(conn, tid, found[1], {})

    def enter(self, conn: sa.Connection, tid: str, token: str, *, lock_timeout_s: float | None) -> str:
        return self.touch(conn, tid, token, lock_timeout_s=lock_timeout_s)

    def store(self, conn: sa.Connection, tid: str, state: str | None, token: str, last: str | None) -> str:
        found = self._lock(conn, tid, None)  # held since enter(): returns at once
        if found is None or _token(found[1]) != token or found[0] != last:
            raise TakenOver(tid)
        return self._bump(conn, tid, found[1], {"prepared_txn_state": state})

    def store_and_commit(self, conn: sa.Connection, tid: str, state: str, token: str, last: str | None) -> str:
        raise IllegalStateError(f"{type(self).__name__} has no combined state update and COMMIT")

    def read_settled(self, conn: sa.Connection, tid: str, *, lock_timeout_s: float) -> str | None:
        found = self._lock(conn, tid, lock_timeout_s)
        return None if found is None else found[0]

    def version(self, conn: sa.Connection, tid: str) -> str | None:
        t = self.table
        row = conn.execute(sa.select(t.c.updated_at).where(self._where(tid))).first()
        return None if row is None else _token(row[0])

    def is_lock_error(self, exc: sa.exc.DBAPIError) -> bool:
        args: tuple[Any, ...] = tuple(getattr(exc.orig, "args", ()))
        return len(args) > 0 and args[0] in self.lock_error_codes


class SQLiteStore(RowLockStore):
    """SQLite: no row locks, one database write lock, taken by the first write and held until COMMIT."""

    def _lock(self, conn: sa.Connection, tid: str, lock_timeout_s: float | None) -> tuple[str | None, Any] | None:
        t = self.table
        # A write (even one that changes nothing) takes the database's write lock; the
        # driver's busy timeout bounds the wait.
        conn.execute(sa.update(t).where(self._where(tid)).values(updated_at=t.c.updated_at))
        row = conn.execute(sa.select(t.c.prepared_txn_state, t.c.updated_at).where(self._where(tid))).first()
        return None if row is None else (row[0], row[1])

    def _create(self, conn: sa.Connection, tid: str) -> None:
        from sqlalchemy.dialects import sqlite

        conn.execute(
            sqlite.insert(self.table)
            .values(transactional_id=tid, prepared_txn_state=None, updated_at=None)
            .on_conflict_do_nothing(index_elements=[self.table.c.transactional_id])
        )

    def read_settled(self, conn: sa.Connection, tid: str, *, lock_timeout_s: float) -> str | None:
        # A COMMIT in this process either happened or not: nothing to wait for, and no write lock to take.
        value: str | None = conn.execute(
            sa.select(self.table.c.prepared_txn_state).where(self._where(tid))
        ).scalar_one_or_none()
        return value

    def is_lock_error(self, exc: sa.exc.DBAPIError) -> bool:
        return "database is locked" in str(exc.orig) or "database table is locked" in str(exc.orig)


class MySQLStore(RowLockStore):
    """MySQL and MariaDB (InnoDB): row locks; the lock timeout is ``innodb_lock_wait_timeout`` (whole
    seconds), set for the locking statement only.  A missing row is created with ``INSERT .. ON
    DUPLICATE KEY UPDATE``, which locks it at once (a ``SELECT .. FOR UPDATE`` of a missing row
    takes a gap lock, and two claimers inserting under gap locks deadlock)."""

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

    def _lock(self, conn: sa.Connection, tid: str, lock_timeout_s: float | None) -> tuple[str | None, Any] | None:
        return self._bounded(conn, lock_timeout_s, lambda: super(MySQLStore, self)._lock(conn, tid, None))

    def _create(self, conn: sa.Connection, tid: str) -> None:
        from sqlalchemy.dialects import mysql

        insert = mysql.insert(self.table).values(transactional_id=tid, prepared_txn_state=None, updated_at=None)
        conn.execute(insert.on_duplicate_key_update(transactional_id=insert.inserted.transactional_id))

    def claim(self, conn: sa.Connection, tid: str, *, lock_timeout_s: float | None) -> Claimed:
        def create_and_lock() -> tuple[str | None, Any] | None:
            self._create(conn, tid)  # locks the row, existing or new
            return RowLockStore._lock(self, conn, tid, None)

        found = self._bounded(conn, lock_timeout_s, create_and_lock)
        if found is None:
            raise IllegalStateError(f"{tid!r}: the state row cannot be created in {self.table.name}")
        state, old = found
        return Claimed(state, self._bump(conn, tid, old, {}))


def _token(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.isoformat(sep=" ", timespec="microseconds")
    return str(value)


def store_for(dialect: sa.Dialect, table: sa.Table) -> StateStore:
    """The store of ``dialect``'s database family (the one place that looks at the dialect's name)."""
    if dialect.name == "postgresql":
        return PostgresStore(table, dialect.driver)
    if dialect.name == "sqlite":
        return SQLiteStore(table)
    if dialect.name in ("mysql", "mariadb"):
        return MySQLStore(table)
    return RowLockStore(table)
