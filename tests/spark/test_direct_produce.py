"""The sink's fast path (Arrow buffers straight to librdkafka), against the real broker, without Spark.

The task code (``write_partition``) runs here as an executor runs it; each
test compares what reached Kafka with what the rows say, or with what the
``produce_batch`` path writes for the same rows.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pyarrow as pa  # type: ignore[import-untyped]
import pytest
from kafka2pc.recipes.spark._config import executor_config
from kafka2pc.recipes.spark._executor import WriterSpec, direct_path, open_producer, write_partition

from kafka2pc import AbortableError, TransactionAdmin
from kafka2pc.testing import drain, end_offsets

HASH = "__kafka2pc_row_hash"


def _batches(keys: list[str | None], values: list[str | None], size: int) -> list[pa.RecordBatch]:
    out = []
    for start in range(0, len(values), size):
        out.append(pa.RecordBatch.from_arrays(
            [pa.array(keys[start:start + size], pa.string()), pa.array(values[start:start + size], pa.string()),
             pa.array(range(start, min(start + size, len(values))), pa.int64())],
            names=["key", "value", HASH],
        ))
    return out


def _spec(bootstrap: str, topic: str, *, direct: bool = True, **config: object) -> WriterSpec:
    return WriterSpec(
        executor_config({"bootstrap.servers": bootstrap, **config}, 60_000), f"direct-{uuid.uuid4().hex[:8]}",
        topic, ("key", "value"), 0, fingerprint_column=HASH, direct_produce=direct,
    )


def _commit(bootstrap: str, spec: WriterSpec, state: str) -> None:
    from kafka2pc import PreparedTxnState

    with TransactionAdmin({"bootstrap.servers": bootstrap}) as admin:
        admin.settle_many({spec.transactional_id(0): PreparedTxnState(state)})


def test_the_fast_path_is_available_here(kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    """On Linux with confluent-kafka's wheel the fast path must be on (else the sink silently gets slower)."""
    spec = _spec(kafka_bootstrap, topic_factory())
    producer = open_producer(spec, 0)
    try:
        assert direct_path(spec, producer) is not None
        assert direct_path(_spec(kafka_bootstrap, "t", direct=False), producer) is None
        assert direct_path(_spec(kafka_bootstrap, "t", **{"message.timeout.ms": 30_000}), producer) is None
    finally:
        producer.abort_transaction(10)
        producer.close()


def test_rows_arrive_as_with_produce_batch(kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    """Same records, same partitions, same order per partition; null keys, null and empty values kept."""
    n = 25_000
    keys: list[str | None] = [None if i % 7 == 0 else f"k{i % 101}" for i in range(n)]
    values: list[str | None] = [None if i % 11 == 0 else ("" if i % 13 == 0 else f"v{i:08d}-é") for i in range(n)]
    (whole,) = _batches(["x", *keys], ["x", *values], n + 1)
    # Batches of 999 rows that are slices of one Arrow batch: offsets that do not start at 0.
    batches = [whole.slice(start, 999) for start in range(1, n + 1, 999)]
    written = {}
    for direct in (True, False):
        topic = topic_factory(partitions=3)
        spec = _spec(kafka_bootstrap, topic, direct=direct)
        result = write_partition(spec, iter(batches), 0, 0)
        assert result is not None and result.records == n
        _commit(kafka_bootstrap, spec, result.state)
        written[direct] = drain(kafka_bootstrap, topic)
    expected = [(None if k is None else k.encode(), None if v is None else v.encode()) for k, v in zip(keys, values)]
    row_of = {kv: i for i, kv in enumerate(expected) if kv[1]}  # the non-empty values are unique
    for direct, records in written.items():
        assert sorted(((r.key, r.value) for r in records), key=repr) == sorted(expected, key=repr), direct
        for partition in {r.partition for r in records}:
            rows = [row_of[(r.key, r.value)] for r in sorted(records, key=lambda r: r.offset)
                    if r.partition == partition and r.value]
            assert rows == sorted(rows), (direct, partition)
    # The same partitioner places every key the same way on both paths (null keys go to a random partition).
    placement = {d: {(r.key, r.value): r.partition for r in rs if r.value and r.key} for d, rs in written.items()}
    assert placement[True] == placement[False]


def test_a_record_the_broker_refuses_fails_the_task(kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    """No delivery callback on the fast path: a refused record must still fail the prepare, and nothing commits."""
    topic = topic_factory(partitions=2, config={"max.message.bytes": "100000"})
    n = 5_000
    values = [f"{i:06d}" for i in range(n)]
    values[3_210] = "y" * 150_000  # within librdkafka's limit, above the topic's: the broker refuses its batch
    spec = _spec(kafka_bootstrap, topic, **{"batch.size": 50_000})
    started = time.monotonic()
    with pytest.raises(AbortableError):
        write_partition(spec, iter(_batches([f"k{i}" for i in range(n)], values, 1_000)), 0, 0)
    # At once, not after the prepare's flush timeout: librdkafka holds back the rest of a failed transaction.
    assert time.monotonic() - started < 30
    assert drain(kafka_bootstrap, topic) == []
    # Aborted, not left open: nothing holds read_committed readers back.
    assert end_offsets(kafka_bootstrap, topic, "read_committed") == end_offsets(kafka_bootstrap, topic)


def test_a_full_queue_is_waited_out_in_order(kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    topic = topic_factory(partitions=1)
    n = 30_000
    spec = _spec(kafka_bootstrap, topic, **{"queue.buffering.max.messages": 2_000})
    result = write_partition(spec, iter(_batches([None] * n, [f"{i:06d}" for i in range(n)], 10_000)), 0, 0)
    assert result is not None and result.records == n
    _commit(kafka_bootstrap, spec, result.state)
    assert [r.value for r in drain(kafka_bootstrap, topic)] == [f"{i:06d}".encode() for i in range(n)]


@pytest.mark.parametrize("refused", [False, True])
def test_check_transaction_sees_a_refused_record_without_any_callback(
    kafka_bootstrap: str, topic_factory: Callable[..., str], refused: bool
) -> None:
    """The fast path's only failure signal: librdkafka's abortable state after the flush, asked by check_transaction."""
    from confluent_kafka import Producer
    from kafka2pc.recipes.spark import _direct

    topic = topic_factory(partitions=1, config={"max.message.bytes": "100000"})
    raw = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"direct-{uuid.uuid4().hex[:8]}",
                    "batch.size": 50_000})
    raw.init_transactions(30)
    raw.begin_transaction()
    handle = _direct.handle_of(raw)
    assert handle is not None
    values = [f"{i:06d}" for i in range(2_000)]
    if refused:
        values[1_500] = "y" * 150_000
    assert _direct.produce_arrow(raw, handle, topic, pa.array(values), None, timeout=30) == len(values)

    def flush_and_check() -> None:
        # After a refused record librdkafka holds the rest back until the abort: the
        # flush would never finish, the state says why.
        for _ in range(60):
            remaining = raw.flush(0.5)
            _direct.check_transaction(raw, "t")
            if remaining == 0:
                return
        raise AssertionError("neither flushed nor failed")

    if refused:
        with pytest.raises(AbortableError, match="failed delivery"):
            flush_and_check()
    else:
        flush_and_check()
    raw.abort_transaction(30)


def test_a_record_librdkafka_refuses_at_once_names_it(kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    from confluent_kafka import Producer
    from kafka2pc.recipes.spark import _direct

    raw = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"direct-{uuid.uuid4().hex[:8]}",
                    "message.max.bytes": 10_000})
    raw.init_transactions(30)
    raw.begin_transaction()
    handle = _direct.handle_of(raw)
    assert handle is not None
    with pytest.raises(AbortableError, match="record 2 of the batch"):
        _direct.produce_arrow(raw, handle, topic_factory(), pa.array([b"a", b"b", b"x" * 20_000, b"c"]), None,
                              timeout=30)
    raw.abort_transaction(30)
