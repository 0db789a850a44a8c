"""``TwoPhaseCommitProducer.produce_batch``: the same records, order and anchor as ``produce``, fewer Python calls.

And ``kafka2pc.delivery.reports=errors``: only failed deliveries reach Python;
the anchor is asked of the partition leaders at prepare.  Every test runs in
both modes: the states, records and errors must not differ.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from kafka2pc import (
    AbortableError,
    IllegalStateError,
    Kafka2pcError,
    QueueFullError,
    TopicAndPartition,
    TwoPhaseCommitProducer,
    TxnState,
    UsageError,
)
from kafka2pc.testing import drain, end_offsets

REPORTS = ["all", "errors"]


@pytest.fixture(params=REPORTS)
def reports(request: pytest.FixtureRequest) -> str:
    """The ``kafka2pc.delivery.reports`` mode of the test's producers."""
    return str(request.param)


def _config(bootstrap: str, reports: str = "all", **extra: Any) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, "transactional.id": f"k2pc-batch-{uuid.uuid4().hex[:8]}",
            "kafka2pc.delivery.reports": reports, **extra}


def test_produce_batch_writes_every_record_in_order_and_anchors_on_the_first(
    kafka_bootstrap: str, topic_factory: Callable[..., str], reports: str
) -> None:
    topic = topic_factory(partitions=3)
    n = 25_000  # more than one slice, and more than the local queue holds (it must wait for room)
    values = [b"v%06d" % i for i in range(n)]
    keys: list[str | bytes | None] = [str(i % 50) for i in range(n)]
    keys[7] = None
    values_with_tombstone: list[str | bytes | None] = [*values, None]
    keys.append(b"tomb")
    with TwoPhaseCommitProducer(_config(kafka_bootstrap, reports, **{"queue.buffering.max.messages": 2_000})) as producer:
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.produce(topic, value=b"before", key=b"0")  # mixes with produce(): one transaction
        assert producer.produce_batch(topic, values_with_tombstone, keys) == n + 1
        state = producer.prepare_transaction(30)
        assert producer.state is TxnState.PREPARED
        producer.commit_transaction(30)

    records = drain(kafka_bootstrap, topic)
    assert len(records) == n + 2
    by_partition: dict[int, list[bytes | None]] = {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        by_partition.setdefault(r.partition, []).append(r.value)
    # Per partition the records keep the order they were given in (librdkafka keeps a key's partition).
    for got in by_partition.values():
        sent = [v for v in got if v not in (b"before", None)]
        assert sent == sorted(sent)
    assert sorted(v for v in values_with_tombstone if v is not None) == sorted(
        r.value for r in records if r.value not in (b"before", None)
    )
    assert [r.key for r in records if r.value is None] == [b"tomb"]
    assert {r.key for r in records if r.value == b"v000007"} == {None}
    # Same partitioner as produce(): every key lands on one partition.
    partitions_of_key: dict[bytes | None, set[int]] = {}
    for r in records:
        partitions_of_key.setdefault(r.key, set()).add(r.partition)
    assert all(len(p) == 1 for p in partitions_of_key.values())
    # The anchor is the transaction's first record on its partition.
    assert state.anchor is not None
    tp, offset = state.anchor
    first = min(r.offset for r in records if r.partition == tp.partition)
    assert tp == TopicAndPartition(topic, tp.partition) and offset == first


def test_produce_batch_to_one_partition(
    kafka_bootstrap: str, topic_factory: Callable[..., str], reports: str
) -> None:
    topic = topic_factory(partitions=2)
    with TwoPhaseCommitProducer(_config(kafka_bootstrap, reports)) as producer:
        producer.init_transactions(30)
        producer.begin_transaction()
        assert producer.produce_batch(topic, ["a", "b", "c"], partition=1) == 3
        assert producer.produce_batch(topic, []) == 0
        state = producer.prepare_transaction(30)
        producer.commit_transaction(30)
    records = drain(kafka_bootstrap, topic)
    assert [(r.partition, r.value, r.key) for r in records] == [(1, b"a", None), (1, b"b", None), (1, b"c", None)]
    assert state.anchor == (TopicAndPartition(topic, 1), records[0].offset)


def test_produce_batch_raises_queue_full_after_its_timeout(
    kafka_bootstrap: str, topic_factory: Callable[..., str], reports: str
) -> None:
    topic = topic_factory()
    # librdkafka holds the records for linger.ms: the queue of 100 stays full.
    config = _config(kafka_bootstrap, reports, **{"queue.buffering.max.messages": 100, "linger.ms": 60_000,
                                                  "batch.num.messages": 1_000_000, "batch.size": 100_000_000})
    with TwoPhaseCommitProducer(config) as producer:
        producer.init_transactions(30)
        producer.begin_transaction()
        started = time.monotonic()
        with pytest.raises(QueueFullError) as caught:
            producer.produce_batch(topic, [b"x"] * 500, timeout=0.5)
        assert 0.5 <= time.monotonic() - started < 5
        assert caught.value.queued == 100
        assert isinstance(caught.value, BufferError)
        assert "100 of 500 records" in str(caught.value)
        producer.abort_transaction(30)
    assert end_offsets(kafka_bootstrap, topic, "read_committed") == end_offsets(kafka_bootstrap, topic)
    assert drain(kafka_bootstrap, topic) == []


def test_produce_batch_refuses_bad_input_and_wrong_states(
    kafka_bootstrap: str, topic_factory: Callable[..., str], reports: str
) -> None:
    topic = topic_factory()
    with TwoPhaseCommitProducer(_config(kafka_bootstrap, reports, **{"message.max.bytes": 10_000})) as producer:
        producer.init_transactions(30)
        with pytest.raises(IllegalStateError):
            producer.produce_batch(topic, [b"no transaction"])
        producer.begin_transaction()
        with pytest.raises(UsageError, match="2 values but 1 keys"):
            producer.produce_batch(topic, [b"a", b"b"], [b"k"])
        with pytest.raises(UsageError, match=r"record 1: .*"):
            producer.produce_batch(topic, [b"a", 42])  # type: ignore[list-item]
        # A record librdkafka refuses locally (too large) raises the translated error, not a raw KafkaException.
        with pytest.raises(Kafka2pcError, match="produce_batch"):
            producer.produce_batch(topic, [b"ok", b"x" * 20_000])
        producer.abort_transaction(30)
    assert drain(kafka_bootstrap, topic) == []


def test_produce_batch_delivery_failure_fails_the_prepare(
    kafka_bootstrap: str, topic_factory: Callable[..., str], reports: str
) -> None:
    """A record the broker refuses (larger than the topic's max.message.bytes) fails prepare, as with produce()."""
    topic = topic_factory(config={"max.message.bytes": "2000"})
    with TwoPhaseCommitProducer(_config(kafka_bootstrap, reports)) as producer:
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.produce_batch(topic, [b"small", b"y" * 5_000, b"small too"])
        with pytest.raises(AbortableError):
            producer.prepare_transaction(30)
        producer.abort_transaction(30)
    assert drain(kafka_bootstrap, topic) == []


def test_errors_only_reports_anchor_exactly_and_recover(kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    """Without success reports the state is the one the delivery reports would have given, and it recovers."""
    from kafka2pc import PreparedTxnState

    topics = [topic_factory(partitions=3), topic_factory(partitions=2)]
    config = _config(kafka_bootstrap, "errors")
    with TwoPhaseCommitProducer(config) as producer:
        producer.init_transactions(30)
        for txn in range(3):  # consecutive transactions share producer id and epoch: only the anchor differs
            producer.begin_transaction()
            producer.produce(topics[1], value=b"p1-%d" % txn, partition=1)  # the first topic written: asked first
            producer.produce_batch(topics[0], [b"%d-%d" % (txn, i) for i in range(30)], [b"%d" % i for i in range(30)])
            producer.produce(topics[1], value=b"p0-%d" % txn, partition=0)
            state = producer.prepare_transaction(30)
            records = drain(kafka_bootstrap, topics[1], "read_uncommitted")
            # Its lowest partition written; the offset of this transaction's record there.
            (own,) = [r for r in records if r.value == b"p0-%d" % txn]
            assert state.anchor == (TopicAndPartition(topics[1], 0), own.offset)
            assert not state.sent_nothing
            if txn < 2:
                producer.commit_transaction(30)
        stored = PreparedTxnState(str(state))
    # The prepared transaction is completed from its stored state by a new producer, as after a crash.
    with TwoPhaseCommitProducer(config) as recovering:
        recovering.init_transactions(30, keep_prepared_txn=True)
        recovering.complete_transaction(stored)
        settlement = recovering.last_settlement
        assert settlement is not None and settlement.outcome.value == "committed"
    assert len(drain(kafka_bootstrap, topics[0])) == 90
    assert sorted(r.value for r in drain(kafka_bootstrap, topics[1]) if r.value) == sorted(
        [b"p1-%d" % t for t in range(3)] + [b"p0-%d" % t for t in range(3)]
    )


def test_errors_only_reports_offsets_only_transaction_anchors_on_its_marker(
    kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    from confluent_kafka import Consumer
    from confluent_kafka import TopicPartition as ConfluentTopicPartition

    topic = topic_factory()
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"g-{uuid.uuid4().hex[:8]}"})
    try:
        with TwoPhaseCommitProducer(_config(kafka_bootstrap, "errors")) as producer:
            producer.init_transactions(30)
            producer.begin_transaction()
            producer.send_offsets_to_transaction([ConfluentTopicPartition(topic, 0, 1)],
                                                 consumer.consumer_group_metadata())
            state = producer.prepare_transaction(30)
            assert state.anchor is not None and state.anchor[0].topic == "kafka2pc-anchors"
            marker = [r for r in drain(kafka_bootstrap, "kafka2pc-anchors", "read_uncommitted")
                      if r.key == producer.transactional_id.encode()]
            assert (state.anchor[0].partition, state.anchor[1]) == (marker[-1].partition, marker[-1].offset)
            producer.abort_transaction(30)
    finally:
        consumer.close()


def test_errors_only_reports_a_transaction_aborted_before_prepare_is_an_abortable_error(
    kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    from kafka2pc import TransactionAdmin

    topic = topic_factory(partitions=2)
    with TwoPhaseCommitProducer(_config(kafka_bootstrap, "errors")) as producer:
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.produce_batch(topic, [b"a", b"b"], [b"1", b"2"])
        assert producer.flush(30) == 0
        with TransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:  # an operator, or a new instance
            assert admin.force_terminate_transaction(producer.transactional_id) is not None
        with pytest.raises(AbortableError, match="no partition the transaction wrote has it open"):
            producer.prepare_transaction(30)
        assert producer.state is TxnState.ABORTABLE_ERROR
    assert drain(kafka_bootstrap, topic) == []


def test_errors_only_reports_find_the_anchor_beyond_partition_0(
    kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    """Keyed records that all landed on partition 2: partition 0 answers nothing, the metadata names the rest."""
    from confluent_kafka import Producer

    probe_topic, topic = topic_factory(partitions=3), topic_factory(partitions=3)
    landed: dict[int, bytes] = {}
    probe = Producer({"bootstrap.servers": kafka_bootstrap})  # the same partitioner, to find a key for partition 2
    for i in range(50):
        key = b"key-%d" % i
        probe.produce(probe_topic, value=b"", key=key,
                      on_delivery=lambda err, msg, k=key: landed.setdefault(msg.partition(), k))
    assert probe.flush(30) == 0
    key = landed[2]
    with TwoPhaseCommitProducer(_config(kafka_bootstrap, "errors")) as producer:
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.produce_batch(topic, [b"a", b"b"], [key, key])
        state = producer.prepare_transaction(30)
        producer.commit_transaction(30)
    records = drain(kafka_bootstrap, topic)
    assert [(r.partition, r.value) for r in records] == [(2, b"a"), (2, b"b")]
    assert state.anchor == (TopicAndPartition(topic, 2), records[0].offset)


def test_a_configured_on_delivery_sees_every_record_sent_without_its_own(
    kafka_bootstrap: str, topic_factory: Callable[..., str], reports: str
) -> None:
    """``on_delivery`` in the configuration is the producer-level callback (as in confluent-kafka):
    it sees the records of ``produce`` and ``produce_batch`` sent without a callback of their own
    (only failures with errors-only reports); a record's own callback replaces it; the anchor holds."""
    topic = topic_factory(partitions=1)
    default: list[tuple[bool, int | None]] = []
    own: list[int | None] = []
    config = _config(kafka_bootstrap, reports,
                     on_delivery=lambda err, msg: default.append((err is None, msg.offset())))
    with TwoPhaseCommitProducer(config) as producer:
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.produce(topic, value=b"a")
        assert producer.produce_batch(topic, [b"b", b"c"]) == 2
        producer.produce(topic, value=b"d", on_delivery=lambda err, msg: own.append(msg.offset()))
        # confluent-kafka's positional order (value, key, partition, on_delivery, timestamp, headers),
        # and ``callback``, its other name for on_delivery (deprecated)
        producer.produce(topic, b"e", b"k", 0, lambda err, msg: own.append(msg.offset()), 1_700_000_000_000,
                         [("h", b"v")])
        with pytest.warns(DeprecationWarning, match="on_delivery"):
            producer.produce(topic, value=b"f", headers={"h": b"w"},
                             callback=lambda err, msg: own.append(msg.offset()))
        state = producer.prepare_transaction(30)
        producer.commit_transaction(30)
    assert state.anchor is not None and state.anchor[1] == 0
    if reports == "all":
        assert default == [(True, 0), (True, 1), (True, 2)]
        assert own == [3, 4, 5]
    else:
        assert default == [] and own == []
    assert [r.value for r in drain(kafka_bootstrap, topic)] == [b"a", b"b", b"c", b"d", b"e", b"f"]


def test_a_configured_on_delivery_sees_failed_records_and_the_prepare_fails(
    kafka_bootstrap: str, topic_factory: Callable[..., str], reports: str
) -> None:
    """A record the broker refuses reaches the configured callback in both modes, and fails the prepare."""
    topic = topic_factory(config={"max.message.bytes": "2000"})
    failed: list[str] = []
    config = _config(kafka_bootstrap, reports,
                     on_delivery=lambda err, msg: failed.append(err.name()) if err is not None else None)
    with TwoPhaseCommitProducer(config) as producer:
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.produce_batch(topic, [b"y" * 5_000])
        with pytest.raises(AbortableError):
            producer.prepare_transaction(30)
        producer.abort_transaction(30)
    assert failed == ["MSG_SIZE_TOO_LARGE"]


def test_a_configured_on_delivery_must_be_callable(kafka_bootstrap: str) -> None:
    with pytest.raises(UsageError, match="on_delivery must be a callable"):
        TwoPhaseCommitProducer(_config(kafka_bootstrap, on_delivery="print"))
