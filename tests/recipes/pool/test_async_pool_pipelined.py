"""``AsyncWriterPool(pipelined=True)``: the Kafka commit completes in a task of the loop, against the real broker.

The transaction returns once the database COMMIT is durable; ``wait_visible``
(the argument, and the method) waits until ``read_committed`` readers see the
records; ``close`` drains what is still in flight.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import aiosqlite  # noqa: F401  - the [aio] extra: missing, the module fails to import (never a skip)
import pytest
import sqlalchemy as sa

from kafka2pc.testing import create_topic, drain


def test_pipelined_async_pool_commits_every_transaction(kafka_bootstrap: str, tmp_path: Path) -> None:
    from kafka2pc.recipes.dual_write import define_lease_table, define_state_table
    from kafka2pc.recipes.dual_write.aio import AsyncWriterPool
    from sqlalchemy.ext.asyncio import create_async_engine

    topic = create_topic(kafka_bootstrap)
    metadata = sa.MetaData()
    items = sa.Table("items", metadata, sa.Column("id", sa.Integer, primary_key=True))
    define_state_table(metadata)
    define_lease_table(metadata)
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    sync_engine = sa.create_engine(url)
    metadata.create_all(sync_engine)
    sync_engine.dispose()
    prefix = f"k2pc-apipe-{uuid.uuid4().hex[:8]}"

    async def main() -> dict[str, int]:
        engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}")
        pool = AsyncWriterPool(engine, {"bootstrap.servers": kafka_bootstrap}, prefix=prefix, size=4, max_slots=2,
                               pipelined=True, max_in_flight=2, slow_commit_s=30.0, start=False)
        with pytest.raises(Exception, match="start=False"):
            async with engine.connect() as conn, pool.transaction(conn):
                pass
        await pool.start()
        try:
            for i in range(6):
                async with engine.connect() as conn, pool.transaction(conn, wait_visible=(i == 0)) as tx:
                    await conn.execute(items.insert().values(id=i))
                    await tx.produce(topic, b"%d" % i)
                if i == 0:  # waited for: visible now
                    assert [r.value for r in drain(kafka_bootstrap, topic)] == [b"0"]
            await pool.wait_visible(timeout=30)
            in_flight = pool.metrics().commits_in_flight
        finally:
            await pool.close()
            await engine.dispose()
        return {"in_flight": in_flight, "committed": pool.metrics().transactions.transactions_committed}

    found = asyncio.run(main())
    assert found["in_flight"] == 0
    assert sorted(r.value for r in drain(kafka_bootstrap, topic)) == [b"%d" % i for i in range(6)]
