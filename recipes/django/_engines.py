"""The two SQLAlchemy engines of one Django database alias: Django's own connection, and connections of the app's own.

The dual write's state store, writer and pool speak SQLAlchemy.  A Django
alias reaches them through two engines built on Django's database settings:

* the **borrowed** engine hands out, in each thread, the DB-API connection
  that Django's ORM uses there (``connections[alias].connection``).  The
  writer's state-row statements then run in the same database transaction as
  the ORM's rows, inside Django's ``transaction.atomic``.  It never opens,
  resets or closes a connection: Django owns them.
* the **own** engine opens connections of its own, with Django's connection
  parameters and set-up (``get_new_connection``, ``init_connection_state``),
  for what must not run in the application's transaction: the pool's leases,
  recoveries, and the read-back of a COMMIT whose outcome was lost.  It holds
  up to ``2 x (max_slots + 2)`` connections per alias and process (see
  ``own_engine``).

The SQLAlchemy dialect follows the DB-API module Django's backend loaded
(psycopg or psycopg2, mysqlclient or PyMySQL installed as ``MySQLdb``,
sqlite3): the one place that looks at the vendor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.pool import ConnectionPoolEntry, Pool

from kafka2pc import UsageError

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = ["BorrowedPool", "TestCasePool", "borrowed_engine", "dialect_url", "own_engine", "savepoint_block",
           "test_case_engine"]

_RECORD_ATTR = "_kafka2pc_pool_entry"
_TEST_CASE_ATTR = "_kafka2pc_test_case_entry"


def dialect_url(wrapper: BaseDatabaseWrapper) -> str:
    """The SQLAlchemy URL (dialect and driver only) matching Django's backend for ``wrapper``."""
    vendor = wrapper.vendor
    module = getattr(wrapper.Database, "__name__", "")
    if vendor == "postgresql":
        return "postgresql+psycopg2://" if module.startswith("psycopg2") else "postgresql+psycopg://"
    if vendor == "sqlite":
        return "sqlite+pysqlite://"
    if vendor == "mysql":
        # PyMySQL installed as MySQLdb (pymysql.install_as_MySQLdb()) is the pymysql module itself.
        return "mysql+pymysql://" if module.startswith("pymysql") else "mysql+mysqldb://"
    raise UsageError(
        f"kafka2pc.recipes.django supports Django's postgresql, sqlite and mysql backends, not {vendor!r} "
        f"(database alias {wrapper.alias!r})"
    )


def _engine_options(url: str) -> dict[str, Any]:
    # Django's sqlite3 connections convert TIMESTAMP columns to datetime themselves (detect_types).
    return {"native_datetime": True} if url.startswith("sqlite") else {}


class BorrowedPool(Pool):
    """A SQLAlchemy pool whose connection, in each thread, is the one Django's ORM uses there.

    One pool entry per Django DB-API connection (kept on Django's connection
    wrapper), so the dialect's per-connection set-up runs once per Django
    connection, not per transaction.  Checking in does nothing: no reset, no
    close.
    """

    def __init__(self, alias: str, **kw: Any) -> None:
        from django.db import connections

        self._alias = alias
        self._connections = connections
        super().__init__(self._current, reset_on_return=None, **kw)

    def _wrapper(self) -> BaseDatabaseWrapper:
        wrapper: BaseDatabaseWrapper = self._connections[self._alias]
        return wrapper

    def _current(self) -> Any:
        wrapper = self._wrapper()
        wrapper.ensure_connection()
        return wrapper.connection

    def _do_get(self) -> ConnectionPoolEntry:
        wrapper = self._wrapper()
        wrapper.ensure_connection()
        entry: ConnectionPoolEntry | None = getattr(wrapper, _RECORD_ATTR, None)
        if entry is None or entry.dbapi_connection is not wrapper.connection:
            entry = self._create_connection()
            setattr(wrapper, _RECORD_ATTR, entry)
        return entry

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        pass  # Django's connection: Django closes it

    def _invalidate(self, connection: Any, exception: BaseException | None = None, _checkin: bool = True) -> None:
        # SQLAlchemy's pool, on a disconnect error, also marks every connection it handed out before as stale
        # and closes it at its next checkout: here those are other threads' healthy Django connections.  Only
        # this connection's pool entry is dropped (Django's error handling closes the dead connection itself).
        if _checkin and getattr(connection, "is_valid", False):
            connection.invalidate(exception)

    def _close_connection(self, connection: Any, *, terminate: bool = False) -> None:
        pass  # Django's connection: an invalidated entry lets go of it, Django closes it

    def status(self) -> str:
        return f"BorrowedPool({self._alias!r})"

    def dispose(self) -> None:
        pass

    def recreate(self) -> BorrowedPool:
        return BorrowedPool(self._alias, _dispatch=self.dispatch, dialect=self._dialect)


class TestCasePool(BorrowedPool):
    """:class:`BorrowedPool` of :func:`test_case_engine` (its own pool entries: another dialect set them up)."""

    def _do_get(self) -> ConnectionPoolEntry:
        wrapper = self._wrapper()
        wrapper.ensure_connection()
        entry: ConnectionPoolEntry | None = getattr(wrapper, _TEST_CASE_ATTR, None)
        if entry is None or entry.dbapi_connection is not wrapper.connection:
            entry = self._create_connection()
            setattr(wrapper, _TEST_CASE_ATTR, entry)
        return entry

    def status(self) -> str:
        return f"TestCasePool({self._alias!r})"

    def recreate(self) -> TestCasePool:
        return TestCasePool(self._alias, _dispatch=self.dispatch, dialect=self._dialect)


_savepoints: dict[int, tuple[BaseDatabaseWrapper, str]] = {}
"""Per DB-API connection (by ``id``) in a test-case block: its Django wrapper and the block's savepoint."""


@contextmanager
def savepoint_block(wrapper: BaseDatabaseWrapper, savepoint: str) -> Iterator[None]:
    """While inside, :func:`test_case_engine`'s rollback on ``wrapper``'s connection rolls back to ``savepoint``."""
    key = id(wrapper.connection)
    _savepoints[key] = (wrapper, savepoint)
    try:
        yield
    finally:
        _savepoints.pop(key, None)


def _commit_in_test_case(dbapi_connection: Any) -> None:
    """Nothing: the rows stay in the test's transaction (Django's atomic releases the block's savepoint)."""


def _rollback_in_test_case(dbapi_connection: Any) -> None:
    """Back to the block's savepoint, on the driver's cursor (past Django's execute wrappers); outside a block,
    nothing (the dialect's first connect)."""
    found = _savepoints.get(id(dbapi_connection))
    if found is None:
        return
    wrapper, savepoint = found
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(wrapper.ops.savepoint_rollback_sql(savepoint))
    finally:
        cursor.close()


def test_case_engine(alias: str) -> sa.Engine:
    """The engine of a dual write inside a ``django.test.TestCase``: Django's connection, in the test's transaction.

    Its COMMIT sends nothing and its ROLLBACK rolls back to the block's
    savepoint (:func:`savepoint_block`): the test's transaction stays open,
    and Django rolls it back at the test's end.  Its first connect runs inside
    the test's transaction (the dialect reads the server version; the
    rollback that follows sends nothing).
    """
    from django.db import connections

    url = dialect_url(connections[alias])
    engine = sa.create_engine(url, pool=TestCasePool(alias), **_engine_options(url))
    # This engine's own dialect instance: its transaction ends are the test case's.
    engine.dialect.do_commit = _commit_in_test_case  # type: ignore[method-assign]
    engine.dialect.do_rollback = _rollback_in_test_case  # type: ignore[method-assign]
    return engine


def borrowed_engine(alias: str) -> sa.Engine:
    """The engine whose connections are Django's own (see the module docstring).

    Its dialect is initialised here, on Django's connection outside any
    transaction (the first connect reads the server version and rolls back).
    """
    from django.db import connections

    wrapper = connections[alias]
    url = dialect_url(wrapper)
    engine = sa.create_engine(url, pool=BorrowedPool(alias), **_engine_options(url))
    if wrapper.in_atomic_block:
        raise UsageError("the borrowed engine is initialised outside transaction.atomic")
    engine.connect().close()
    return engine


_settings_lock = threading.Lock()


def own_engine(alias: str, *, pool_size: int) -> sa.Engine:
    """An engine with connections of its own, opened and set up as Django opens those of ``alias``.

    A ``QueuePool`` of ``pool_size`` connections plus as many overflow
    connections: at most ``2 x pool_size`` open at once.
    """
    from django.db import connections

    wrapper = connections.create_connection(alias)  # a private wrapper: only its parameters and set-up are used
    wrapper.inc_thread_sharing()  # the pool connects from any thread, one at a time (under _settings_lock)
    url = dialect_url(wrapper)

    def connect() -> Any:
        with _settings_lock:
            conn = wrapper.get_new_connection(wrapper.get_connection_params())
            # Django's own set-up of a new connection: PostgreSQL's time zone and assume_role, MySQL's
            # isolation level and sql_mode checks, SQLite's init_command (committed by Django if it must be).
            wrapper.connection = conn
            try:
                wrapper.init_connection_state()
            except BaseException:
                conn.close()
                raise
            finally:
                wrapper.connection = None
        if wrapper.vendor == "sqlite":
            conn.isolation_level = ""  # the sqlite3 module's own transactions, as SQLAlchemy expects
        return conn

    return sa.create_engine(url, creator=connect, poolclass=sa.pool.QueuePool, pool_size=pool_size,
                            max_overflow=pool_size,
                            pool_pre_ping=True, **_engine_options(url))
