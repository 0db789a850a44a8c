"""AsyncTwoPhaseCommitProducer against the real broker: steady state, delivery futures, cancellation, errors."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer
from confluent_kafka import TopicPartition as ConfluentTopicPartition
from harness.loop import run

from kafka2pc import (
    FatalError,
    HeuristicOutcomeError,
    IllegalStateError,
    Kafka2pcError,
    PreparedTxnState,
    ProducerFencedError,
    TopicAndPartition,
    TransactionalIdMismatchError,
    TransactionOutcome,
    TwoPhaseCommitProducer,
    TxnState,
    UsageError,
)
from kafka2pc.aio import AsyncTransactionAdmin, AsyncTwoPhaseCommitProducer, LoopStallMonitor
from kafka2pc.testing import drain


def config(bootstrap: str, tid: str, **extra: object) -> dict[str, object]:
    return {"bootstrap.servers": bootstrap, "transactional.id": tid, **extra}


def test_many_concurrent_transactions_on_several_producers_from_one_loop(
    kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory(partitions=3)
    producers, txns, records = 4, 15, 5

    async def worker(n: int) -> list[PreparedTxnState]:
        states: list[PreparedTxnState] = []
        tid = f"k2pc-aio-steady-{n}-{uuid.uuid4().hex[:6]}"
        async with AsyncTwoPhaseCommitProducer(config(kafka_bootstrap, tid, **{"linger.ms": 2})) as p:
            await p.init_transactions(30)
            after_init = p.sync_producer.control_plane.requests_sent
            for t in range(txns):
                await p.begin_transaction()
                futures = [await p.produce(topic, value=f"{n}-{t}-{i}".encode()) for i in range(records)]
                state = await p.prepare_transaction(30)
                # prepare waited for every record: the delivery futures are resolved before it returns
                assert all(f.done() and f.exception() is None for f in futures)
                delivered = {
                    (TopicAndPartition(m.topic(), m.partition()), m.offset()) for m in (f.result() for f in futures)
                }
                assert state.anchor in delivered  # the state names a record of this transaction
                assert p.state is TxnState.PREPARED
                await p.commit_transaction(30)
                states.append(state)
            assert p.sync_producer.control_plane.requests_sent == after_init  # nothing per transaction
        return states

    async def main() -> tuple[list[list[PreparedTxnState]], str]:
        async with LoopStallMonitor() as monitor:
            results = await asyncio.gather(*(worker(n) for n in range(producers)))
        return results, monitor.report.summary()

    results, summary = run(main())
    print(f"\n{producers} producers x {txns} transactions: loop {summary}")
    all_states = [s for states in results for s in states]
    assert len(set(all_states)) == producers * txns  # each state names its own transaction
    got = sorted(r.value for r in drain(kafka_bootstrap, topic) if r.value)
    assert got == sorted(
        f"{n}-{t}-{i}".encode() for n in range(producers) for t in range(txns) for i in range(records)
    )


def test_calls_run_on_the_producers_own_thread_and_delivery_futures_on_the_loop(
    kafka_bootstrap: str, topic_factory: Callable[..., str], tid: str
) -> None:
    topic = topic_factory()
    threads: set[str] = set()

    async def main() -> None:
        loop_thread = threading.current_thread().name
        async with AsyncTwoPhaseCommitProducer(config(kafka_bootstrap, tid)) as p:
            await p.init_transactions(30)
            await p.begin_transaction()
            delivered = await p.produce(topic, value=b"one", key=b"k", headers=[("h", b"v")])
            delivered.add_done_callback(lambda _f: threads.add(threading.current_thread().name))
            message = await asyncio.wait_for(delivered, 30)  # served by the idle poll, before prepare
            assert (message.topic(), message.partition(), message.offset()) == (topic, 0, 0)
            assert (message.key(), message.value()) == (b"k", b"one")
            # produce_and_wait: one await, the delivered message (aiokafka's send_and_wait)
            second = await p.produce_and_wait(topic, value=b"two", partition=0, timestamp=1_700_000_000_000)
            assert (second.partition(), second.offset(), second.value()) == (0, 1, b"two")
            assert second.timestamp()[1] == 1_700_000_000_000
            state = await p.prepare_transaction(30)
            assert state.anchor == (TopicAndPartition(topic, 0), 0)
            await p.commit_transaction(30)
        assert threads == {loop_thread}

    run(main())
    assert [r.value for r in drain(kafka_bootstrap, topic)] == [b"one", b"two"]


def test_a_cancelled_prepare_completes_and_the_next_call_sees_its_state(
    kafka_bootstrap: str, topic_factory: Callable[..., str], tid: str
) -> None:
    topic = topic_factory()

    async def main() -> None:
        async with AsyncTwoPhaseCommitProducer(config(kafka_bootstrap, tid)) as p:
            await p.init_transactions(30)
            await p.begin_transaction()
            await p.produce(topic, value=b"kept")
            for _ in range(1000):  # 20 MB: the flush inside prepare takes a while
                await p.produce(topic, value=b"x" * 20_000)
            prepare = asyncio.ensure_future(p.prepare_transaction(60))
            await asyncio.sleep(0)  # submitted to the producer's thread
            prepare.cancel()
            with pytest.raises(asyncio.CancelledError):
                await prepare
            assert p.in_flight == ("prepare_transaction",)
            with pytest.raises(IllegalStateError, match="prepare_transaction"):
                await p.produce(topic, value=b"slipped-in")
            assert await p.wait_idle() is TxnState.PREPARED
            assert p.in_flight == ()
            state = p.prepared_state
            assert state is not None and state.anchor == (TopicAndPartition(topic, 0), 0)
            await p.complete_transaction(state)
            assert p.state is TxnState.READY

    run(main())
    values = [r.value for r in drain(kafka_bootstrap, topic)]
    assert values[0] == b"kept" and len(values) == 1001 and b"slipped-in" not in values


def test_a_cancelled_commit_still_commits_and_calls_stay_ordered(
    kafka_bootstrap: str, topic_factory: Callable[..., str], tid: str
) -> None:
    topic = topic_factory()

    async def main() -> None:
        async with AsyncTwoPhaseCommitProducer(config(kafka_bootstrap, tid)) as p:
            await p.init_transactions(30)
            await p.begin_transaction()
            await p.produce(topic, value=b"first")
            await p.prepare_transaction(30)
            commit = asyncio.ensure_future(p.commit_transaction(30))
            await asyncio.sleep(0)  # submitted
            commit.cancel()
            # queued behind the cancelled commit: it starts from READY, not from PREPARED
            await p.begin_transaction()
            assert p.state is TxnState.IN_TRANSACTION
            await p.produce(topic, value=b"second")
            await p.prepare_transaction(30)
            await p.commit_transaction(30)
            assert commit.cancelled()

    run(main())
    assert [r.value for r in drain(kafka_bootstrap, topic)] == [b"first", b"second"]


def test_errors_are_the_kafka2pc_classes(kafka_bootstrap: str, topic_factory: Callable[..., str], tid: str) -> None:
    topic = topic_factory()
    with pytest.raises(UsageError, match="transactional.id"):
        AsyncTwoPhaseCommitProducer({"bootstrap.servers": kafka_bootstrap})
    with pytest.raises(UsageError, match="transaction.timeout.ms"):
        AsyncTwoPhaseCommitProducer(config(kafka_bootstrap, tid, **{"transaction.timeout.ms": "soon"}))

    async def main() -> None:
        p = AsyncTwoPhaseCommitProducer(config(kafka_bootstrap, tid))
        with pytest.raises(IllegalStateError, match="init_transactions"):
            await p.begin_transaction()
        await p.init_transactions(30)
        with pytest.raises(IllegalStateError):
            await p.produce(topic, value=b"outside a transaction")
        with pytest.raises(UsageError, match="PreparedTxnState"):
            await p.complete_transaction("1:2")  # type: ignore[arg-type]
        await p.begin_transaction()
        await p.produce(topic, value=b"doomed")
        state = await p.prepare_transaction(30)
        other = PreparedTxnState._build(state.producer_id, state.epoch, tid + "-other", None, -1)
        with pytest.raises(TransactionalIdMismatchError):
            await p.complete_transaction(other)
        assert p.state is TxnState.PREPARED

        # A newer instance fences this one: its commit fails with the sync producer's class.
        newer = TwoPhaseCommitProducer(config(kafka_bootstrap, tid))
        await asyncio.to_thread(newer.init_transactions, 30)
        with pytest.raises(ProducerFencedError) as raised:
            await p.commit_transaction(30)
        assert isinstance(raised.value, FatalError)
        assert p.state is TxnState.FATAL_ERROR
        with pytest.raises(IllegalStateError, match="fatal"):
            await p.begin_transaction()
        await p.close()
        with pytest.raises(IllegalStateError, match="closed"):
            await p.begin_transaction()
        await asyncio.to_thread(newer.close)

    run(main())
    assert drain(kafka_bootstrap, topic) == []


def test_a_producer_is_bound_to_one_loop(kafka_bootstrap: str, tid: str) -> None:
    p = AsyncTwoPhaseCommitProducer(config(kafka_bootstrap, tid))
    run(p.init_transactions(30))
    with pytest.raises(UsageError, match="event loop"):
        run(p.begin_transaction())
    assert p.state is TxnState.READY
    p.sync_producer.close()


def test_bad_settings_are_refused() -> None:
    cfg = {"bootstrap.servers": "127.0.0.1:1", "transactional.id": "x"}
    with pytest.raises(UsageError, match="delivery_poll_interval_s"):
        AsyncTwoPhaseCommitProducer(cfg, delivery_poll_interval_s=0)
    with pytest.raises(UsageError, match="queue_full_timeout_s"):
        AsyncTwoPhaseCommitProducer(cfg, queue_full_timeout_s=-1)


def test_a_prepared_transaction_the_broker_aborted_is_a_heuristic_outcome(
    kafka_bootstrap: str, topic_factory: Callable[..., str], tid: str
) -> None:
    topic = topic_factory()

    async def main() -> None:
        # librdkafka cannot open 2PC transactions: the broker aborts this one after 3 s.
        first = AsyncTwoPhaseCommitProducer(config(kafka_bootstrap, tid, **{"transaction.timeout.ms": 3000}))
        await first.init_transactions(30)
        await first.begin_transaction()
        await first.produce(topic, value=b"expires")
        state = await first.prepare_transaction(30)
        async with AsyncTransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:
            deadline = time.monotonic() + 40  # the test broker looks for expired transactions every second
            while (info := await admin.describe_transaction(tid)) is not None and info.is_open:
                assert time.monotonic() < deadline, "the broker did not abort the expired transaction"
                await asyncio.sleep(0.5)
            assert await admin.transaction_outcome(tid, state) is TransactionOutcome.ABORTED

        async with AsyncTwoPhaseCommitProducer(config(kafka_bootstrap, tid)) as recovering:
            await recovering.init_transactions(keep_prepared_txn=True)
            with pytest.raises(HeuristicOutcomeError) as raised:
                await recovering.complete_transaction(state)
            assert raised.value.outcome == "aborted" and raised.value.state == state
            assert recovering.state is TxnState.READY  # settled (by Kafka): the producer moves on
        # The expired instance cannot commit any more: a kafka2pc error, never a raw KafkaException.
        with pytest.raises(Kafka2pcError):
            await first.commit_transaction(30)
        await first.close()

    run(main())
    assert drain(kafka_bootstrap, topic) == []


def test_consume_transform_produce_commits_the_offsets_with_the_transaction(
    kafka_bootstrap: str, topic_factory: Callable[..., str], tid: str
) -> None:
    source, sink = topic_factory(), topic_factory()
    group = f"k2pc-aio-group-{uuid.uuid4().hex[:6]}"
    seed = TwoPhaseCommitProducer(config(kafka_bootstrap, f"{tid}-seed"))
    seed.init_transactions(30)
    seed.begin_transaction()
    for i in range(3):
        seed.produce(source, value=b"in-%d" % i)
    seed.commit_transaction(30)
    seed.close()
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group, "enable.auto.commit": False,
                         "auto.offset.reset": "earliest", "isolation.level": "read_committed"})
    consumer.subscribe([source])

    async def main() -> None:
        async with AsyncTwoPhaseCommitProducer(config(kafka_bootstrap, tid)) as p:
            await p.init_transactions(30)
            messages = await asyncio.to_thread(consumer.consume, 3, 30)  # the consumer blocks: not on the loop
            assert [m.value() for m in messages] == [b"in-0", b"in-1", b"in-2"]
            await p.begin_transaction()
            for m in messages:
                await p.produce(sink, value=m.value().replace(b"in", b"out"))
            await p.send_offsets_to_transaction(consumer.position(consumer.assignment()),
                                                consumer.consumer_group_metadata(), 30)
            await p.prepare_transaction(30)
            await p.commit_transaction(30)

    try:
        run(main())
        committed = consumer.committed([ConfluentTopicPartition(source, 0)], timeout=30)
    finally:
        consumer.close()
    assert committed[0].offset == 3  # the position after the 3 consumed records, committed with the output
    assert [r.value for r in drain(kafka_bootstrap, sink)] == [b"out-0", b"out-1", b"out-2"]


@pytest.mark.parametrize("prepared_by", ["sync", "async"])
def test_a_state_prepared_by_one_api_is_completed_by_the_other(
    kafka_bootstrap: str, topic_factory: Callable[..., str], tid: str, prepared_by: str
) -> None:
    """Same PreparedTxnState format: a sync service's prepared transaction is settled by an async one, and back."""
    topic = topic_factory()

    async def prepare_async() -> str:
        p = AsyncTwoPhaseCommitProducer(config(kafka_bootstrap, tid))
        await p.init_transactions(30)
        await p.begin_transaction()
        await p.produce(topic, value=b"prepared")
        text = str(await p.prepare_transaction(30))
        await p.close()  # gone without committing, as after a crash
        return text

    def prepare_sync() -> str:
        p = TwoPhaseCommitProducer(config(kafka_bootstrap, tid))
        p.init_transactions(30)
        p.begin_transaction()
        p.produce(topic, value=b"prepared")
        text = str(p.prepare_transaction(30))
        p.close()
        return text

    async def complete_async(text: str) -> None:
        async with AsyncTwoPhaseCommitProducer(config(kafka_bootstrap, tid)) as p:
            await p.init_transactions(keep_prepared_txn=True)
            await p.complete_transaction(PreparedTxnState(text))
            assert p.last_settlement is not None and p.last_settlement.outcome is TransactionOutcome.COMMITTED

    def complete_sync(text: str) -> None:
        with TwoPhaseCommitProducer(config(kafka_bootstrap, tid)) as p:
            p.init_transactions(keep_prepared_txn=True)
            p.complete_transaction(PreparedTxnState(text))
            assert p.last_settlement is not None and p.last_settlement.outcome is TransactionOutcome.COMMITTED

    if prepared_by == "sync":
        run(complete_async(prepare_sync()))
    else:
        complete_sync(run(prepare_async()))
    assert [r.value for r in drain(kafka_bootstrap, topic)] == [b"prepared"]
