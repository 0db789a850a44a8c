"""Reading the prepared states the dual-write recipe stored, with plain SQLAlchemy Core.

The recipe keeps one row per transactional id::

    kafka_transaction_state (
        transactional_id   VARCHAR PRIMARY KEY,
        prepared_txn_state VARCHAR(255) NULL,   -- str(PreparedTxnState); NULL/'' = empty state
        updated_at         TIMESTAMP
    )

The CLI reads those three columns itself, so that listing works on any
database the recipe wrote (and on tables an application keeps in the same
shape); settling uses the recipe's state store, so that the locking protocol
exists once.
It never changes a row's values: settling happens in Kafka, and the rows
record what the *database* decided, which recovery must not change.  Before
``recover`` settles anything for a transactional id it claims that row
(:class:`RowLocks`) exactly as the recipe's own recovery does, with the same
state store: it locks the row (so it never settles a transaction whose commit
is under way), gives it a new version and commits that *before* touching
Kafka.  A live writer's token is void from then on, so it can never commit a
transaction Kafka no longer holds, even if this process dies mid-way.

Imported only by the ``in-doubt`` and ``recover`` commands (SQLAlchemy is heavy).
"""

from __future__ import annotations

import datetime
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kafka2pc._extras import missing_extra

try:
    import sqlalchemy as sa
    from sqlalchemy.pool import NullPool
except ImportError as exc:
    raise missing_extra(exc, extra="sql", feature="kafka2pc in-doubt/recover (the state database)") from exc

from ._errors import CliFailure, ExitCode

__all__ = ["DEFAULT_TABLE", "RowLocks", "StoredState", "masked_url", "read_ids", "read_states"]

DEFAULT_TABLE = "kafka_transaction_state"


@dataclass(frozen=True)
class StoredState:
    """One row of the state table: a transactional id and the prepared state the database committed."""

    transactional_id: str
    prepared_txn_state: str | None
    """``None`` when the column is NULL or blank (the empty state)."""
    updated_at: str | None
    """ISO 8601 text of ``updated_at`` as the database returned it."""


def _engine_url(db_url: str) -> sa.URL:
    url = sa.make_url(db_url)
    if url.drivername == "postgresql" and importlib.util.find_spec("psycopg2") is None:
        # SQLAlchemy's default PostgreSQL driver is psycopg2; kafka2pc depends on psycopg 3.
        url = url.set(drivername="postgresql+psycopg")
    if url.drivername in ("mysql", "mariadb") and importlib.util.find_spec("MySQLdb") is None:
        if importlib.util.find_spec("pymysql") is not None:
            # SQLAlchemy's default MySQL driver is mysqlclient; kafka2pc's mysql extra installs PyMySQL.
            url = url.set(drivername=f"{url.drivername}+pymysql")
    return url


def masked_url(db_url: str) -> str:
    """The URL with its password replaced by ``***`` (safe to print)."""
    try:
        return sa.make_url(db_url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return "<unparsable URL>"


def _connect_args(url: sa.URL, timeout_s: float) -> dict[str, object]:
    backend = url.get_backend_name()
    if backend == "postgresql":
        return {"connect_timeout": max(1, int(timeout_s))}
    if backend == "mysql":
        return {"connect_timeout": max(1, int(timeout_s))}
    if backend == "sqlite":
        return {"timeout": timeout_s}
    return {}


def _iso(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, (datetime.datetime, datetime.date)):
        return value.isoformat()
    return str(value)


def read_states(db_url: str, table: str = DEFAULT_TABLE, *, timeout_s: float = 15.0) -> list[StoredState]:
    """Every row of ``table`` (``schema.table`` allowed), ordered by transactional id.

    Raises :class:`CliFailure` (exit code ``DATABASE``) for a missing SQLite
    file or table; other database failures surface as SQLAlchemy errors, which
    the CLI maps to the same exit code.
    """
    url = _engine_url(db_url)
    shown = url.render_as_string(hide_password=True)
    if url.get_backend_name() == "sqlite":
        database = url.database or ""
        if database and database != ":memory:" and not database.startswith("file:"):
            if not Path(database).is_file():
                raise CliFailure(f"database error: SQLite file {database} does not exist", ExitCode.DATABASE)
    schema, _, name = table.rpartition(".")
    try:
        engine = sa.create_engine(url, connect_args=_connect_args(url, timeout_s), poolclass=NullPool)
    except ImportError as exc:
        raise CliFailure(
            f"database error: no driver for {url.drivername} is installed ({exc}); install it, or name an "
            "installed one in the URL (e.g. postgresql+psycopg://...); for PostgreSQL: "
            "pip install 'kafka2pc[postgres]'",
            ExitCode.DATABASE,
        ) from exc
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table(name, schema=schema or None):
                raise CliFailure(f"database error: table {table!r} not found in {shown}", ExitCode.DATABASE)
            state_table = sa.table(
                name,
                sa.column("transactional_id"),
                sa.column("prepared_txn_state"),
                sa.column("updated_at"),
                schema=schema or None,
            )
            query = sa.select(
                state_table.c.transactional_id, state_table.c.prepared_txn_state, state_table.c.updated_at
            ).order_by(state_table.c.transactional_id)
            rows = conn.execute(query).all()
    finally:
        engine.dispose()
    return [
        StoredState(
            transactional_id=str(tid),
            prepared_txn_state=str(state).strip() if state is not None and str(state).strip() else None,
            updated_at=_iso(updated),
        )
        for tid, state, updated in rows
    ]


def read_ids(db_url: str, table: str, *, timeout_s: float = 15.0) -> set[str]:
    """The ``transactional_id`` column of ``table`` (e.g. a ``WriterPool``'s lease table)."""
    url = _engine_url(db_url)
    schema, _, name = table.rpartition(".")
    engine = sa.create_engine(url, connect_args=_connect_args(url, timeout_s), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table(name, schema=schema or None):
                shown = url.render_as_string(hide_password=True)
                raise CliFailure(f"database error: table {table!r} not found in {shown}", ExitCode.DATABASE)
            ids = sa.table(name, sa.column("transactional_id"), schema=schema or None)
            return {str(tid) for (tid,) in conn.execute(sa.select(ids.c.transactional_id))}
    finally:
        engine.dispose()


class HeldRow:
    """The state row :meth:`RowLocks.hold` has locked (and claimed, not yet committed)."""

    def __init__(self, state: str | None, conn: sa.Connection) -> None:
        self.state = state
        """The stored prepared state (``None`` = empty)."""
        self._conn = conn
        self.claimed = False

    def claim(self) -> None:
        """Commit the claim now, before Kafka is touched: from here on no writer that owned the id
        can commit its database side (its token is void), whatever happens to this process next.
        The stored state is unchanged; the row lock is released."""
        if not self.claimed:
            self._conn.commit()
            self.claimed = True

    def taken_over(self) -> None:
        """Record that the transactional id was fenced: the claim is committed when the lock is released."""
        self.changed = True

    changed = False


class RowLocks:
    """Holds one state row's lock at a time while its transaction is settled.

    The lock is the recipe's own claim (:mod:`kafka2pc.recipes.dual_write`'s
    state store, one per database family): the row is locked, read and given
    a new version, values unchanged.  :meth:`HeldRow.claim` commits that
    before anything is settled in Kafka; a claim that was not needed is rolled
    back when the lock is released, so no row ever changes.
    """

    def __init__(self, db_url: str, table: str = DEFAULT_TABLE, *, timeout_s: float = 15.0) -> None:
        # kafka2pc.recipes lives in recipes/ (a package-dir mapping mypy cannot follow from cli/).
        from kafka2pc.recipes.dual_write import define_state_table, store_for  # type: ignore[import-not-found,unused-ignore]

        url = _engine_url(db_url)
        self._engine = sa.create_engine(url, connect_args=_connect_args(url, timeout_s), poolclass=NullPool)
        schema, _, name = table.rpartition(".")
        self._store = store_for(self._engine.dialect, define_state_table(sa.MetaData(), name, schema=schema or None))
        self._timeout_s = timeout_s

    @contextmanager
    def hold(self, transactional_id: str) -> Iterator[HeldRow]:
        """Lock (claim, uncommitted) the row of ``transactional_id``; yield its current prepared state."""
        with self._engine.connect() as conn:
            conn.begin()
            try:
                claimed = self._store.claim(conn, transactional_id, lock_timeout_s=self._timeout_s)
                text = str(claimed.state).strip() if claimed.state is not None else ""
                held = HeldRow(text or None, conn)
                yield held
            except BaseException:
                # The settlement failed part-way: it may have fenced the writer, so tell it.
                try:
                    conn.commit()
                except sa.exc.SQLAlchemyError:
                    conn.rollback()
                raise
            if held.changed or held.claimed:
                conn.commit()
            else:
                conn.rollback()

    def close(self) -> None:
        """Release the connection pool."""
        self._engine.dispose()
