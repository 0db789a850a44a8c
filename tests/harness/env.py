"""What a dual-write test writes and checks: a topic, a series of ids and the dual write's tables in one database."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa
from kafka2pc.recipes.dual_write import DualWriter, define_outbox_table, define_state_table
from kafka2pc.recipes.dual_write.aio import AsyncDualWriter
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import Session

from harness.adw_crash import async_url
from harness.dw_crash import check_consistency, items_table
from kafka2pc.testing import create_topic, drain


def session_committing_apart(engine: sa.Engine) -> Session:
    """A Session whose ``commit()`` may write (a ``before_commit`` listener): the writer sends its state
    update and its COMMIT in two round trips on every database, holding the row lock in between (the
    window a test pauses in).  A Session without one sends both at once on PostgreSQL, as a Connection does."""
    session = Session(engine)
    sa.event.listen(session, "before_commit", lambda _session: None)
    return session


class Env:
    """A fresh topic and series in the database at ``url``, with the state, outbox and items tables created.

    Ids carry the series (``<series>:<rid>``) so that tests can share a
    database; :meth:`rows` and :meth:`records` give them back without it.
    Writers get the transactional id ``<tid_prefix>-<series>`` unless told
    another.  ``state_table`` names the state table (and ``ob_<name>`` the
    outbox) instead of the defaults.
    """

    def __init__(self, url: str, bootstrap: str, *, tid_prefix: str = "dw", state_table: str | None = None) -> None:
        self.url = url
        self.engine = sa.create_engine(url)
        self.bootstrap = bootstrap
        self.topic = create_topic(bootstrap)
        self.series = uuid.uuid4().hex[:10]
        self.tid_prefix = tid_prefix
        metadata = sa.MetaData()
        if state_table is None:
            self.states, self.outbox = define_state_table(metadata), define_outbox_table(metadata)
        else:
            self.states = define_state_table(metadata, state_table)
            self.outbox = define_outbox_table(metadata, f"ob_{state_table}")
        self.items = items_table(metadata)
        self.metadata = metadata
        """The three tables (``metadata.drop_all`` drops them)."""
        metadata.create_all(self.engine)

    def _config(self, tid: str | None) -> dict[str, str]:
        return {"bootstrap.servers": self.bootstrap, "transactional.id": tid or f"{self.tid_prefix}-{self.series}"}

    def writer(self, tid: str | None = None, **kwargs: Any) -> DualWriter:
        return DualWriter(self.engine, self._config(tid), state_table=self.states, outbox_table=self.outbox, **kwargs)

    def write(self, bind: Any, tx: Any, rid: str) -> None:
        """One row and its record, on ``bind`` (a Connection or a Session) in ``tx``."""
        full = f"{self.series}:{rid}"
        bind.execute(self.items.insert().values(id=full, series=self.series))
        tx.produce(self.topic, value=full.encode(), key=full.encode())

    def commit_one(self, writer: DualWriter, rid: str) -> None:
        with self.engine.connect() as conn, writer.transaction(conn) as tx:
            self.write(conn, tx, rid)

    def async_engine(self) -> AsyncEngine:
        return create_async_engine(async_url(self.url))

    def async_writer(self, engine: AsyncEngine, tid: str | None = None, **kwargs: Any) -> AsyncDualWriter:
        return AsyncDualWriter(engine, self._config(tid), state_table=self.states, outbox_table=self.outbox, **kwargs)

    async def write_async(self, bind: Any, tx: Any, rid: str) -> None:
        """:meth:`write` on an ``AsyncConnection`` or ``AsyncSession``."""
        full = f"{self.series}:{rid}"
        await bind.execute(self.items.insert().values(id=full, series=self.series))
        await tx.produce(self.topic, value=full.encode(), key=full.encode())

    async def commit_one_async(self, engine: AsyncEngine, writer: AsyncDualWriter, rid: str) -> None:
        async with engine.connect() as conn, writer.transaction(conn) as tx:
            await self.write_async(conn, tx, rid)

    def rows(self) -> set[str]:
        with self.engine.connect() as conn:
            ids = conn.execute(sa.select(self.items.c.id).where(self.items.c.series == self.series)).scalars()
            return {i.split(":", 1)[1] for i in ids}

    def records_in_order(self) -> list[str]:
        """The ``read_committed`` records, in offset order."""
        return [r.value.decode().split(":", 1)[1] for r in drain(self.bootstrap, self.topic) if r.value]

    def records(self) -> list[str]:
        """The ``read_committed`` records, sorted (duplicates kept)."""
        return sorted(self.records_in_order())

    def assert_consistent(self) -> None:
        _, _, problems = check_consistency(self.engine, self.bootstrap, self.topic, self.series)
        assert not problems, problems
