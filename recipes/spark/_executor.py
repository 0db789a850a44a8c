"""Executor side of the Spark sink: one Kafka transaction per partition, written and prepared.

Everything here runs in PySpark's Python workers (``mapInArrow``): it is
pickled with the :class:`WriterSpec` and must not touch the SparkSession.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kafka2pc import QueueFullError, TransactionAdmin, TwoPhaseCommitProducer, UsageError

from ._values import PartitionResult, UnknownTopicError, combine_fingerprints

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]

logger = logging.getLogger("kafka2pc.recipes.spark_sink")


class TaskStep(str, enum.Enum):
    """Named points of one task attempt, passed to the sink's task hook (a testing seam)."""

    OPENED = "opened"
    """The transaction is begun and the first non-empty Arrow batch is in hand; nothing produced yet."""
    PREPARED = "prepared"
    """The transaction is prepared and the producer closed; the result is not returned yet."""


@dataclass(frozen=True)
class TaskPoint:
    """What a task hook is told: where the task is, and enough to act like another attempt.

    ``rows`` holds the Arrow batches the attempt has in hand (at
    :attr:`TaskStep.OPENED` the first one, at :attr:`TaskStep.PREPARED`
    every one it wrote); the task keeps them only when a hook is set.
    """

    step: TaskStep
    spec: WriterSpec
    partition: int
    attempt: int
    rows: tuple[pa.RecordBatch, ...]


TaskHook = Callable[[TaskPoint], None]
"""The executor-side hook (a testing aid): pickled to the executors, called at each :class:`TaskStep`.

An exception it raises fails the task attempt (Spark retries it).
"""


_admins: dict[tuple[tuple[str, str], ...], TransactionAdmin] = {}
_admins_lock = threading.Lock()


def shared_admin(config: Mapping[str, Any]) -> TransactionAdmin:
    """One coordinator connection per Python worker and cluster, reused by its tasks (and the driver's workers).

    PySpark reuses worker processes across tasks, so this saves a metadata
    bootstrap per task; the producer itself is created per task on purpose
    (its ``init_transactions`` is what fences other attempts).
    """
    key = tuple(sorted((k, str(v)) for k, v in config.items() if k != "transactional.id"))
    with _admins_lock:
        admin = _admins.get(key)
        if admin is None:
            admin = _admins[key] = TransactionAdmin(dict(key))
        return admin


@dataclass(frozen=True)
class WriterSpec:
    """Everything a task needs to write its partition; pickled to the executors.

    ``only_partitions`` (a repair run) limits writing to those partition
    indexes; the others drain their input.  ``task_hook`` is called at each
    :class:`TaskStep` (never in repair runs).  ``fingerprint_column`` holds
    each row's hash; the task sums them into the partition's fingerprint.
    """

    producer_config: Mapping[str, Any]
    transactional_id_base: str
    topic: str | None
    columns: tuple[str, ...]
    batch_id: int
    only_partitions: frozenset[int] | None = None
    task_hook: TaskHook | None = None
    fingerprint_column: str | None = None
    """The column with each row's ``xxhash64`` (added by the driver); absent when ``None``."""

    def transactional_id(self, partition: int) -> str:
        """The transactional id partition ``partition`` writes under."""
        return f"{self.transactional_id_base}-{partition}"


def attempt_transactional_id(base: str, partition: int, slot: int, attempt: int) -> str:
    """The data source's transactional id for one task attempt: ``<base>-<partition>.<slot>.<attempt>``.

    Every attempt has its own id, so a late speculative copy never re-initialises
    (and so aborts) the transaction of the attempt whose result was decided; the
    stray sweep after each commit aborts the copies' transactions.  ``slot``
    differs from every slot the latest decision uses, so the replay of a decided
    batch after a driver restart leaves the decided transactions alone.
    """
    return f"{base}-{partition}.{slot}.{attempt}"


def open_producer(spec: WriterSpec, partition: int, transactional_id: str | None = None) -> TwoPhaseCommitProducer:
    """A producer under partition ``partition``'s id with a begun transaction (fences every other attempt)."""
    config = dict(spec.producer_config)
    config["transactional.id"] = transactional_id or spec.transactional_id(partition)
    producer = TwoPhaseCommitProducer(config, control_plane=shared_admin(config).control_plane)
    producer.init_transactions()  # fences every other attempt using this id; aborts what it left open
    producer.begin_transaction()
    return producer


def _produce_one(producer: TwoPhaseCommitProducer, topic: str, **kwargs: Any) -> None:
    while True:
        try:
            producer.produce(topic, **kwargs)
            return
        except QueueFullError:
            producer.poll(0.05)


_known_topics: set[tuple[str, str]] = set()
_QUEUE_FULL_TIMEOUT_S = 300.0
"""How long a task waits for room in librdkafka's queue (the broker is slow or gone) before failing."""


def require_topics(spec: WriterSpec, topics: Iterable[str | None]) -> None:
    """Raise :class:`UnknownTopicError` naming the first topic the cluster does not have.

    Without this check librdkafka would hold the record until the topic's
    metadata propagation timeout (30 s) and then fail without naming it.
    Known topics are cached per Python worker; an unknown one is looked up
    once more before it counts as missing.
    """
    cluster = str(spec.producer_config.get("bootstrap.servers", ""))
    missing = {t for t in topics if t is not None and (cluster, t) not in _known_topics}
    if not missing:
        return
    existing = set(shared_admin(spec.producer_config).topic_names())
    _known_topics.update((cluster, t) for t in existing)
    for topic in sorted(missing):
        if topic not in existing:
            raise UnknownTopicError(f"topic {topic!r} does not exist (batch {spec.batch_id})")


def batch_fingerprint(spec: WriterSpec, batch: pa.RecordBatch) -> int:
    """The sum of the rows' hashes in ``batch`` (exact, as a Python int)."""
    if spec.fingerprint_column is None:
        return 0
    import pyarrow as pa
    import pyarrow.compute as pc  # type: ignore[import-untyped]

    hashes = batch.column(batch.schema.names.index(spec.fingerprint_column))
    # Split each signed 64-bit hash into a low and an (arithmetic) high half so
    # that the vectorised int64 sums cannot overflow below 2**31 rows.
    low = pc.sum(pc.bit_wise_and(hashes, pa.scalar(0xFFFFFFFF, pa.int64()))).as_py() or 0
    high = pc.sum(pc.shift_right(hashes, pa.scalar(32, pa.int64()))).as_py() or 0
    return int(low) + (int(high) << 32)


def produce_batch(producer: TwoPhaseCommitProducer, spec: WriterSpec, batch: pa.RecordBatch) -> int:
    """Produce one Arrow record batch; return the number of records."""
    names = batch.schema.names
    values = batch.column(names.index("value")).to_pylist()
    keys = batch.column(names.index("key")).to_pylist() if "key" in names else None
    topics = (
        batch.column(names.index("topic")).to_pylist() if spec.topic is None and "topic" in names else None
    )
    if topics is not None:
        require_topics(spec, set(topics))
    partitions = batch.column(names.index("partition")).to_pylist() if "partition" in names else None
    headers = batch.column(names.index("headers")).to_pylist() if "headers" in names else None
    if topics is None and partitions is None and headers is None:
        # The common shapes go to librdkafka in one call per Arrow batch: the
        # Python per-record cost is what limits this sink's throughput.
        topic = spec.topic
        if topic is None:
            raise UsageError("no topic column and no topic option")
        return producer.produce_batch(topic, values, keys, timeout=_QUEUE_FULL_TIMEOUT_S)
    produce = producer.produce
    for i, value in enumerate(values):
        kwargs: dict[str, Any] = {"value": value}
        if keys is not None and keys[i] is not None:
            kwargs["key"] = keys[i]
        if partitions is not None and partitions[i] is not None:
            kwargs["partition"] = int(partitions[i])
        if headers is not None and headers[i]:
            kwargs["headers"] = [(h["key"], h["value"]) for h in headers[i]]
        topic = spec.topic if topics is None else topics[i]
        if topic is None:
            raise UsageError(f"row {i} has a null topic and no topic option is set")
        try:
            produce(topic, **kwargs)
        except QueueFullError:
            _produce_one(producer, topic, **kwargs)
    return len(values)


def write_partition(
    spec: WriterSpec, batches: Iterable[pa.RecordBatch], partition: int, attempt: int,
    transactional_id: str | None = None,
) -> PartitionResult | None:
    """Write one partition's rows in one Kafka transaction and prepare it (runs on an executor).

    Returns ``None`` for an empty partition (its producer is initialised, which
    fences older attempts, but no transaction reaches the coordinator).  The
    transaction is left *prepared*: only the driver, once the decision is
    durable, commits it.  On failure the transaction is aborted if possible
    and the exception propagates, so Spark retries the task; a retry's
    ``init_transactions`` fences this attempt and aborts what it left open.
    ``transactional_id`` replaces the partition's id (the data source's per-attempt ids).
    """
    hook = spec.task_hook
    kept: list[pa.RecordBatch] = []
    if spec.only_partitions is not None and partition not in spec.only_partitions:
        return _read_only(spec, batches, partition, attempt)
    records = 0
    fingerprint = 0
    started = time.monotonic()
    # Open (init_transactions) before pulling the first rows: the JVM computes the
    # input meanwhile.  (Opening on a helper thread while buffering the first rows
    # measured no faster: the GIL is shared with the Arrow reads.)
    tid = transactional_id or spec.transactional_id(partition)
    producer = open_producer(spec, partition, tid)
    open_s = time.monotonic() - started
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if hook is not None:
                if records == 0:
                    hook(TaskPoint(TaskStep.OPENED, spec, partition, attempt, (batch,)))
                kept.append(batch)
            records += produce_batch(producer, spec, batch)
            fingerprint += batch_fingerprint(spec, batch)
            producer.poll(0)
        if records == 0:
            producer.close()  # nothing was sent: the transaction never reached the coordinator
            return None
        write_done = time.monotonic()
        state = producer.prepare_transaction()
        prepare_s = time.monotonic() - write_done
    except BaseException:
        _abort_quietly(producer)
        raise
    producer.close()  # leaves the prepared transaction open: the driver decides
    logger.info("partition %d attempt %d: prepared %s with %d records", partition, attempt, state, records)
    if hook is not None:
        hook(TaskPoint(TaskStep.PREPARED, spec, partition, attempt, tuple(kept)))
    return PartitionResult(
        partition, attempt, tid, str(state), records, open_s, write_done - started - open_s, prepare_s,
        combine_fingerprints([fingerprint]) if spec.fingerprint_column is not None else "",
    )


def _read_only(
    spec: WriterSpec, batches: Iterable[pa.RecordBatch], partition: int, attempt: int
) -> PartitionResult | None:
    """A repair run's partition that is not rewritten: count and fingerprint its rows, write nothing."""
    records = 0
    fingerprint = 0
    for batch in batches:
        records += batch.num_rows
        fingerprint += batch_fingerprint(spec, batch)
    if records == 0:
        return None
    return PartitionResult(partition, attempt, "", "", records, 0.0, 0.0, 0.0, combine_fingerprints([fingerprint]))


def _abort_quietly(producer: TwoPhaseCommitProducer) -> None:
    try:
        producer.abort_transaction(10)
    except Exception as exc:  # noqa: BLE001 - fenced, or the broker is gone: the next init / the driver aborts it
        logger.info("%s: could not abort after a failure: %s", producer.transactional_id, exc)
    try:
        producer.close()
    except Exception as exc:  # noqa: BLE001 - best effort; the original failure is what matters
        logger.debug("%s: close after a failure: %s", producer.transactional_id, exc)


@dataclass(frozen=True)
class ArrowWriter:
    """The ``mapInArrow`` function: one result row per non-empty partition."""

    spec: WriterSpec

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is None:
            raise UsageError("the sink's writer must run inside a Spark task")
        result = write_partition(self.spec, batches, ctx.partitionId(), ctx.attemptNumber())
        if result is not None:
            yield pa.RecordBatch.from_pylist([dataclasses.asdict(result)], schema=_result_arrow_schema())


def _result_arrow_schema() -> pa.Schema:
    import pyarrow as pa

    return pa.schema([
        ("partition", pa.int32()), ("attempt", pa.int32()), ("transactional_id", pa.string()),
        ("state", pa.string()), ("records", pa.int64()), ("open_s", pa.float64()),
        ("write_s", pa.float64()), ("prepare_s", pa.float64()), ("fingerprint", pa.string()),
    ])
