"""The two SQLAlchemy engines of one Django database alias: Django's own connection, and connections of the app's own.

The dual write's state store, writer and pool speak SQLAlchemy.  A Django
alias reaches them through two engines built on Django's database settings:

* the **borrowed** engine hands out, in each thread, the DB-API connection
  that Django's ORM uses there (``connections[alias].connection``).  The
  writer's state-row statements then run in the same database transaction as
  the ORM's rows, inside Django's ``transaction.atomic``.  It never opens,
  resets or closes a connection: Django owns them.
* the **own** engine opens connections of its own, with Django's connection
  parameters (``DatabaseWrapper.get_new_connection``), for what must not run
  in the application's transaction: the pool's leases, recoveries, and the
  read-back of a COMMIT whose outcome was lost.

The SQLAlchemy dialect follows the DB-API module Django's backend loaded
(psycopg or psycopg2, mysqlclient or PyMySQL installed as ``MySQLdb``,
sqlite3): the one place that looks at the vendor.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.pool import ConnectionPoolEntry, Pool

from kafka2pc import UsageError

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = ["BorrowedPool", "borrowed_engine", "dialect_url", "own_engine"]

_RECORD_ATTR = "_kafka2pc_pool_entry"


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

    def status(self) -> str:
        return f"BorrowedPool({self._alias!r})"

    def dispose(self) -> None:
        pass

    def recreate(self) -> BorrowedPool:
        return BorrowedPool(self._alias, _dispatch=self.dispatch, dialect=self._dialect)


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
    """An engine with connections of its own, opened with Django's settings of ``alias``."""
    from django.db import connections

    wrapper = connections.create_connection(alias)  # a private wrapper: only its parameters are used
    url = dialect_url(wrapper)

    def connect() -> Any:
        with _settings_lock:
            params = wrapper.get_connection_params()
        conn = wrapper.get_new_connection(params)
        if wrapper.vendor == "sqlite":
            conn.isolation_level = ""  # the sqlite3 module's own transactions, as SQLAlchemy expects
        return conn

    return sa.create_engine(url, creator=connect, poolclass=sa.pool.QueuePool, pool_size=pool_size,
                            max_overflow=pool_size,
                            pool_pre_ping=True, **_engine_options(url))
