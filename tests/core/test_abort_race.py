"""librdkafka's abort race (#4849): the core's abort (kafka2pc._abort_race) through every caller.

The core producers (sync and asyncio) produce, wait 0-20 ms and abort (then
close); the four writer kinds of the dual-write recipe produce and raise in
their block (then close), which aborts through the same core path.  A short
sample, drawn from the test's seed (``$KAFKA2PC_SEED``), of
``benchmarks/bench_abort_race.py`` (which runs 2,000 and 500 cycles per
writer kind): every abort succeeds (a writer's caller sees its own
exception), librdkafka logs no FATAL line, and the coordinator holds no
transaction open under any id used (DescribeTransactions), with the topic's
LSO at its high watermark.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from kafka2pc.recipes.dual_write import DualWriter, WriterPool, define_lease_table, define_state_table
from kafka2pc.recipes.dual_write.aio import AsyncDualWriter, AsyncWriterPool
from sqlalchemy.ext.asyncio import create_async_engine

from kafka2pc import TopicAndPartition, TransactionAdmin, TwoPhaseCommitProducer
from kafka2pc.aio import AsyncTwoPhaseCommitProducer
from kafka2pc.testing import create_topic

CYCLES = 60
CLOSE_CYCLES = 8


class Boom(Exception):
    """The block's own exception."""


def _producer_kind(config: dict[str, Any], topic: str, rng: random.Random) -> set[str]:
    series, tids = uuid.uuid4().hex[:8], set()

    def make(n: int) -> TwoPhaseCommitProducer:
        tids.add(f"race-{series}-{n}")
        producer = TwoPhaseCommitProducer({**config, "transactional.id": f"race-{series}-{n}"})
        producer.init_transactions(30)
        return producer

    def one(producer: TwoPhaseCommitProducer) -> None:
        pause = rng.uniform(0, 0.02)
        producer.begin_transaction()
        producer.produce(topic, value=b"never")
        time.sleep(pause)
        producer.abort_transaction(30)

    producer = make(0)
    for _ in range(CYCLES):
        one(producer)
    producer.close()
    for n in range(1, CLOSE_CYCLES + 1):
        producer = make(n)
        one(producer)
        producer.close()
    return tids


async def _async_producer_kind(config: dict[str, Any], topic: str, rng: random.Random) -> set[str]:
    series, tids = uuid.uuid4().hex[:8], set()

    async def make(n: int) -> AsyncTwoPhaseCommitProducer:
        tids.add(f"race-{series}-{n}")
        producer = AsyncTwoPhaseCommitProducer({**config, "transactional.id": f"race-{series}-{n}"})
        await producer.init_transactions(30)
        return producer

    async def one(producer: AsyncTwoPhaseCommitProducer) -> None:
        pause = rng.uniform(0, 0.02)
        await producer.begin_transaction()
        await producer.produce(topic, value=b"never")
        await asyncio.sleep(pause)
        await producer.abort_transaction(30)

    producer = await make(0)
    for _ in range(CYCLES):
        await one(producer)
    await producer.close()
    for n in range(1, CLOSE_CYCLES + 1):
        producer = await make(n)
        await one(producer)
        await producer.close()
    return tids


def _sync_kind(kind: str, url: str, config: dict[str, Any], topic: str, rng: random.Random) -> set[str]:
    engine = sa.create_engine(url)
    metadata = sa.MetaData()
    states, leases = define_state_table(metadata), define_lease_table(metadata)
    metadata.create_all(engine)
    series, tids = uuid.uuid4().hex[:8], set()

    def make(n: int) -> Any:
        if kind == "DualWriter":
            tids.add(f"race-{series}-{n}")
            writer = DualWriter(engine, {**config, "transactional.id": f"race-{series}-{n}"}, state_table=states)
            writer.recover()
            return writer
        tids.add(f"race-{series}-{n}-0")
        return WriterPool(engine, config, prefix=f"race-{series}-{n}", size=1, state_table=states,
                          lease_table=leases)

    def one(target: Any) -> None:
        pause = rng.uniform(0, 0.02)
        with pytest.raises(Boom), engine.connect() as conn, target.transaction(conn) as tx:
            tx.produce(topic, value=b"never")
            time.sleep(pause)
            raise Boom

    target = make(0)
    for _ in range(CYCLES):
        one(target)
    target.close()
    for n in range(1, CLOSE_CYCLES + 1):
        target = make(n)
        one(target)
        target.close()
    engine.dispose()
    return tids


async def _async_kind(kind: str, url: str, config: dict[str, Any], topic: str, rng: random.Random) -> set[str]:
    engine = create_async_engine(url)
    states, leases = define_state_table(sa.MetaData()), define_lease_table(sa.MetaData())
    series, tids = uuid.uuid4().hex[:8], set()

    async def make(n: int) -> Any:
        if kind == "AsyncDualWriter":
            tids.add(f"race-{series}-{n}")
            writer = AsyncDualWriter(engine, {**config, "transactional.id": f"race-{series}-{n}"},
                                     state_table=states)
            await writer.recover()
            return writer
        tids.add(f"race-{series}-{n}-0")
        return AsyncWriterPool(engine, config, prefix=f"race-{series}-{n}", size=1, state_table=states,
                               lease_table=leases)

    async def one(target: Any) -> None:
        pause = rng.uniform(0, 0.02)
        with pytest.raises(Boom):
            async with engine.connect() as conn, target.transaction(conn) as tx:
                await tx.produce(topic, value=b"never")
                await asyncio.sleep(pause)
                raise Boom

    target = await make(0)
    for _ in range(CYCLES):
        await one(target)
    await target.close()
    for n in range(1, CLOSE_CYCLES + 1):
        target = await make(n)
        await one(target)
        await target.close()
    await engine.dispose()
    return tids


def test_produce_raise_close_leaves_nothing_open_and_logs_no_fatal_line(
    pg_url: str, kafka_bootstrap: str, caplog: pytest.LogCaptureFixture, seed: int
) -> None:
    config = {"bootstrap.servers": kafka_bootstrap}
    topic = create_topic(kafka_bootstrap, partitions=1)
    tids: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="kafka2pc.librdkafka"):
        tids |= _producer_kind(config, topic, random.Random(seed))
        tids |= asyncio.run(_async_producer_kind(config, topic, random.Random(seed)))
        for kind in ("DualWriter", "WriterPool"):
            tids |= _sync_kind(kind, pg_url, config, topic, random.Random(seed))
        for kind in ("AsyncDualWriter", "AsyncWriterPool"):
            tids |= asyncio.run(_async_kind(kind, pg_url, config, topic, random.Random(seed)))
    fatal = [r.getMessage() for r in caplog.records if r.name == "kafka2pc.librdkafka" and "FATAL" in r.getMessage()]
    assert fatal == []
    with TransactionAdmin(config) as admin:
        described = {tid: admin.describe_transaction(tid, timeout=30) for tid in sorted(tids)}
        open_ids = [tid for tid, info in described.items() if info is not None and info.state == "Ongoing"]
        assert open_ids == [], open_ids
        assert len(tids) == 6 * (1 + CLOSE_CYCLES)
        _, lso, hw = admin.control_plane.partition_offsets(TopicAndPartition(topic, 0), timeout=30)
    assert lso == hw
