"""The asyncio twins' methods that the sync classes had alone, against the real broker: they answer as the sync ones.

``AsyncTwoPhaseCommitProducer.poll``/``produce_batch``/``flush`` and ``produce(on_delivery=)``;
``AsyncTransactionAdmin.partitions``/``diagnose_connection``/``bounded``/``transaction_outcome(settled=)``;
``AsyncDualWriteTransaction.connection``; and the one ``produce`` spelling on the sync producer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from kafka2pc import (
    BrokerUnavailableError,
    TopicAndPartition,
    TransactionAdmin,
    TransactionOutcome,
    TwoPhaseCommitProducer,
)
from kafka2pc.aio import AsyncTransactionAdmin, AsyncTwoPhaseCommitProducer
from kafka2pc.testing import create_topic, drain


def _config(bootstrap: str) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, "transactional.id": f"k2pc-twin-{uuid.uuid4().hex[:10]}"}


def test_async_producer_poll_produce_batch_flush_and_on_delivery(kafka_bootstrap: str) -> None:
    topic = create_topic(kafka_bootstrap, partitions=2)
    delivered: list[tuple[Any, Any]] = []

    async def main() -> None:
        async with AsyncTwoPhaseCommitProducer(_config(kafka_bootstrap)) as producer:
            await producer.init_transactions(30)
            await producer.begin_transaction()
            loop_thread = asyncio.get_running_loop()

            def on_delivery(err: Any, msg: Any) -> None:
                assert asyncio.get_running_loop() is loop_thread  # runs on the loop
                delivered.append((err, msg))

            future = await producer.produce(topic, b"one", b"k", 1, on_delivery)
            assert await producer.produce_batch(topic, [b"two", b"three"], partition=0) == 2
            assert await producer.flush(10) == 0
            assert await producer.poll(0.1) >= 0
            message = await future
            assert message.partition() == 1
            await producer.prepare_transaction(30)
            await producer.commit_transaction(30)
            await asyncio.sleep(0)  # the delivery future's callbacks run

    asyncio.run(main())
    assert [(err, msg.value()) for err, msg in delivered] == [(None, b"one")]
    assert sorted(r.value for r in drain(kafka_bootstrap, topic) if r.value) == [b"one", b"three", b"two"]


def test_sync_produce_takes_the_one_parameter_list(kafka_bootstrap: str) -> None:
    """Keywords in any order, confluent-kafka's positional order, and its -1/0 sentinels (deprecated)."""
    topic = create_topic(kafka_bootstrap, partitions=2)
    seen: list[int] = []
    with TwoPhaseCommitProducer(_config(kafka_bootstrap)) as producer:
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.produce(topic, b"a", b"k", partition=1, on_delivery=lambda err, msg: seen.append(msg.partition()))
        producer.produce(topic, b"b", None, 0, lambda err, msg: seen.append(msg.partition()), None, None)
        with pytest.warns(DeprecationWarning, match="partition=None"):
            producer.produce(topic, b"c", partition=-1, timestamp=0)
        producer.prepare_transaction(30)
        producer.commit_transaction(30)
    assert sorted(seen) == [0, 1]
    assert sorted(r.value for r in drain(kafka_bootstrap, topic) if r.value) == [b"a", b"b", b"c"]


def test_async_admin_partitions_bounded_diagnose_and_settled_outcome(kafka_bootstrap: str) -> None:
    topic = create_topic(kafka_bootstrap, partitions=3)
    config = _config(kafka_bootstrap)
    with TwoPhaseCommitProducer(config) as producer:
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.produce(topic, b"x")
        state = producer.prepare_transaction(30)
        producer.commit_transaction(30)
    with TransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:
        expected = admin.partitions(topic=topic)

    async def main() -> None:
        async with AsyncTransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:
            assert await admin.partitions(topic=topic) == expected == [TopicAndPartition(topic, i) for i in range(3)]
            assert await admin.diagnose_connection(timeout=5) is None  # plaintext: nothing more to learn
            tid = config["transactional.id"]
            assert await admin.transaction_outcome(tid, state, settled=True) is TransactionOutcome.COMMITTED
            assert await admin.transaction_outcome(tid, state) is TransactionOutcome.COMMITTED
            async with admin.bounded(20):
                assert topic in await admin.topic_names()
        async with AsyncTransactionAdmin({"bootstrap.servers": "127.0.0.1:1"}, timeout_s=30) as unreachable:
            started = time.monotonic()
            with pytest.raises(BrokerUnavailableError):
                async with unreachable.bounded(1.0):
                    await unreachable.topic_names()  # its own bound would be 30 s
            assert time.monotonic() - started < 5

    asyncio.run(main())


def test_async_dual_write_transaction_connection(kafka_bootstrap: str, tmp_path: Path) -> None:
    from kafka2pc.recipes.dual_write import define_state_table
    from kafka2pc.recipes.dual_write.aio import AsyncDualWriter
    from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

    topic = create_topic(kafka_bootstrap)
    metadata = sa.MetaData()
    items = sa.Table("items", metadata, sa.Column("id", sa.Integer, primary_key=True))
    define_state_table(metadata)
    sync_engine = sa.create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    metadata.create_all(sync_engine)
    sync_engine.dispose()

    async def main() -> int:
        engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")
        try:
            async with AsyncDualWriter(engine, _config(kafka_bootstrap)) as writer:
                async with engine.connect() as conn, writer.transaction(conn) as tx:
                    assert isinstance(tx.connection, AsyncConnection) and tx.connection is conn
                    await tx.connection.execute(items.insert().values(id=7))
                    await tx.produce(topic, b"seven")
                assert writer.state.value == "ready"
            async with engine.connect() as conn:
                return int((await conn.execute(sa.select(sa.func.count()).select_from(items))).scalar_one())
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == 1
    assert [r.value for r in drain(kafka_bootstrap, topic) if r.value] == [b"seven"]
