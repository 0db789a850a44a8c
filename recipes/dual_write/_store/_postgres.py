"""PostgreSQL's store: ``xmin`` is the row's version, checked optimistically in the guarded update."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

import sqlalchemy as sa

from kafka2pc import IllegalStateError

from .._schema import _ROW_CHANGED, _STATE_FUNCTION_ARGS, _qualified, state_function_name
from ._protocol import Claimed, TakenOver, _utcnow

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["PostgresStore"]

logger = logging.getLogger("kafka2pc.recipes.dual_write._store")

# PostgreSQL's system column naming the transaction that wrote a row version: the
# state row's optimistic concurrency token (compared as text, 32-bit xid: a false
# match needs 2**32 transactions between a writer's two commits *and* a hit).
_XMIN: Final[sa.ColumnClause[str]] = sa.literal_column("CAST(xmin AS text)")


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
