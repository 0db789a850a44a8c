"""Exactly-once Kafka sink for Spark Structured Streaming, by two-phase commit.

Spark's built-in Kafka sink is at-least-once: when a micro-batch is replayed
(driver restart, task retry) its rows are written again.  This sink writes
every row exactly once.  Use it as a ``foreachBatch`` function::

    from kafka2pc.recipes.spark_sink import KafkaTwoPhaseSink

    sink = KafkaTwoPhaseSink({"bootstrap.servers": "broker:9092"}, topic="out")
    query = (df.selectExpr("CAST(id AS STRING) AS key", "payload AS value")
               .writeStream.foreachBatch(sink)
               .option("checkpointLocation", "hdfs:///checkpoints/q1")
               .start())

Input columns are those of Spark's Kafka sink: ``value`` (required, string or
binary), ``key`` (string or binary), ``topic`` (string; the ``topic`` option
overrides it, as in Spark), ``partition`` (int) and ``headers``
(``array<struct<key: string, value: binary>>``).

The protocol (Spark's driver is the coordinator, one Kafka transaction per
partition of the micro-batch is a participant):

1. *Settle leftovers.*  Every transaction still open under this sink's
   transactional ids (a crashed run's, a zombie task's) is settled with the
   last durable decision: committed if the decision names it, aborted
   otherwise.  Nothing new is written before that.
2. *Replay check.*  If a decision for this batch id is already durable (the
   driver died after deciding), the batch is not written again: the decision
   is completed (step 5) and the batch is done.
3. *Write and prepare* (executors).  Each partition's rows are produced in one
   transaction under the transactional id ``<prefix><sink id>-<partition>``
   and prepared (flushed); the task returns the :class:`~kafka2pc.PreparedTxnState`.
4. *Decide.*  The driver collects the states of the successful task attempts
   and writes the decision ``batch id -> states`` durably (atomic create of a
   new file under the query's checkpoint location) -- the commit point.
5. *Complete.*  The driver commits every named transaction through the
   coordinator (:func:`kafka2pc._recovery.settle`: commit only an open
   transaction whose producer id and anchor offset match the recorded state,
   abort anything else), waits for the commit markers, aborts every other
   open transaction of the sink, and records metrics.  A recorded
   transaction that Kafka aborted meanwhile (a late speculative attempt
   re-initialised its id, or the transaction timed out) is *repaired*: that
   partition is written again, the decision gets a new revision naming the
   new state, and it is completed.  Since an aborted
   transaction can never commit, the rows still land exactly once.

Why retries and speculation are safe, and the storage requirements for the
decisions, are explained in ``docs/spark.md``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import signal
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from kafka2pc._control import ControlPlane
from kafka2pc._exceptions import Kafka2pcError, UsageError
from kafka2pc._producer import (
    LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS,
    QueueFullError,
    TwoPhaseCommitProducer,
)
from kafka2pc._recovery import Decision, TransactionOutcome, outcome_of, settle
from kafka2pc._state import PreparedTxnState

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "BatchMetrics",
    "DecisionStore",
    "FaultInjection",
    "HadoopDecisionStore",
    "KafkaTwoPhaseSink",
    "LocalDecisionStore",
    "PartitionResult",
    "SinkDecision",
    "SinkTransaction",
    "write_partition",
]

logger = logging.getLogger(__name__)

DEFAULT_PREFIX: Final = "kafka2pc-spark-"
FAULTS_ENV: Final = "KAFKA2PC_SPARK_FAULTS"
"""Environment variable with a JSON :class:`FaultInjection` (testing aid; empty in production)."""

_DECISION_FORMAT: Final = "kafka2pc-spark-decision/1"
_NAME_RE: Final = re.compile(r"[A-Za-z0-9._-]{1,120}")
_DECISION_FILE_RE: Final = re.compile(r"(\d{1,19})\.(\d{1,6})\.json")
_RESULT_COLUMNS: Final = (
    "partition", "attempt", "transactional_id", "state", "records", "open_s", "write_s", "prepare_s",
)


# ---------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SinkTransaction:
    """One prepared transaction named by a decision: partition ``partition`` of the batch."""

    partition: int
    transactional_id: str
    state: str
    records: int

    @property
    def prepared_state(self) -> PreparedTxnState:
        """The parsed :class:`~kafka2pc.PreparedTxnState`."""
        return PreparedTxnState(self.state)


@dataclass(frozen=True)
class SinkDecision:
    """The commit decision for one micro-batch: exactly these transactions are to commit.

    ``revision`` grows when a repair replaces the state of a partition whose
    transaction Kafka aborted; the highest revision of a batch is the decision.
    """

    sink_id: str
    batch_id: int
    revision: int
    transactions: tuple[SinkTransaction, ...]
    created_ms: int = 0

    def to_json(self) -> bytes:
        """Serialize (UTF-8 JSON, one object)."""
        return json.dumps(
            {
                "format": _DECISION_FORMAT,
                "sink_id": self.sink_id,
                "batch_id": self.batch_id,
                "revision": self.revision,
                "created_ms": self.created_ms,
                "transactions": [dataclasses.asdict(t) for t in self.transactions],
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> SinkDecision:
        """Parse what :meth:`to_json` wrote; raise :class:`~kafka2pc.UsageError` on anything else."""
        try:
            obj = json.loads(data)
            if obj.get("format") != _DECISION_FORMAT:
                raise ValueError(f"unknown format {obj.get('format')!r}")
            txns = tuple(
                SinkTransaction(int(t["partition"]), str(t["transactional_id"]), str(t["state"]), int(t["records"]))
                for t in obj["transactions"]
            )
            for txn in txns:
                PreparedTxnState(txn.state)  # validate
            return cls(str(obj["sink_id"]), int(obj["batch_id"]), int(obj["revision"]), txns,
                       int(obj.get("created_ms", 0)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UsageError(f"corrupt sink decision: {exc}") from exc

    def by_transactional_id(self) -> dict[str, SinkTransaction]:
        """The named transactions keyed by transactional id."""
        return {t.transactional_id: t for t in self.transactions}


@dataclass(frozen=True)
class PartitionResult:
    """What one task attempt returns to the driver after preparing its partition's transaction."""

    partition: int
    attempt: int
    transactional_id: str
    state: str
    records: int
    open_s: float
    write_s: float
    prepare_s: float


@dataclass(frozen=True)
class BatchMetrics:
    """What the sink did for one micro-batch (also logged at INFO).

    ``stray_transactions_aborted`` counts open transactions of this sink that
    the batch's decision does not name (zombie attempts) aborted after the
    commit; ``leftovers_aborted`` those of a crashed run aborted before the
    first write of this driver process.  ``task_attempts`` maps each
    partition to the attempt number whose result was used.
    ``write_s`` is the Spark job that writes and prepares; ``task_open_s``,
    ``task_write_s`` and ``task_prepare_s`` are the slowest task's time to open
    its transaction (``init_transactions``, which fences other attempts), to
    produce its rows, and to prepare (flush).
    ``time_to_visibility_s`` runs from the call of the sink to the last commit
    (the batch's rows are then visible to ``read_committed`` consumers);
    ``commit_latency_s`` is the part the two-phase commit adds after the last
    task finished: writing the decision plus completing the transactions.
    """

    batch_id: int
    replayed: bool
    records: int
    partitions: int
    transactions_prepared: int
    transactions_committed: int
    stray_transactions_aborted: int
    leftovers_aborted: int
    repaired_partitions: tuple[int, ...]
    task_attempts: Mapping[int, int]
    settle_s: float
    write_s: float
    task_open_s: float
    task_write_s: float
    task_prepare_s: float
    decision_s: float
    completion_s: float
    time_to_visibility_s: float
    commit_latency_s: float

    @property
    def rows_per_second(self) -> float:
        """Records divided by time to visibility."""
        return self.records / self.time_to_visibility_s if self.time_to_visibility_s > 0 else 0.0


@dataclass(frozen=True)
class FaultInjection:
    """Crash and failure points for tests; never set in production.

    Driver crash points (``crash_at``): ``"after_prepare"`` (states collected,
    no decision), ``"after_decision"`` (decision durable, nothing committed),
    ``"mid_completion"`` (the first transaction committed, the others not).
    With ``crash_marker`` the driver writes that file and blocks, waiting to be
    killed (so a test can SIGKILL the whole process group, JVM included);
    without it the driver SIGKILLs itself.  ``crash_batch`` limits the crash to
    one batch id.

    Task faults: ``fail_task_at="after_prepare"`` makes attempts numbered below
    ``fail_task_attempts`` raise right after preparing (their transaction stays
    open, as after an executor crash).  ``duplicate_attempt`` runs a second
    writer of the same partition under the same transactional id inside
    attempt 0, as speculative execution would: ``"fences_original"`` starts it
    right after the original opened its transaction (it fences the original,
    whose writes must then fail, so Spark retries the task) and
    ``"after_prepare"`` starts it after the original prepared (a late copy: its
    ``init_transactions`` aborts the original's prepared transaction, and it
    leaves its own open; the original still reports success).
    ``fail_partitions`` and ``task_batch`` limit task faults to those
    partition indexes and that batch.  Repair runs never get task faults.
    """

    crash_at: str | None = None
    crash_batch: int | None = None
    crash_marker: str | None = None
    fail_task_at: str | None = None
    fail_task_attempts: int = 1
    duplicate_attempt: str | None = None
    fail_partitions: tuple[int, ...] | None = None
    task_batch: int | None = None

    @classmethod
    def from_env(cls) -> FaultInjection | None:
        """Read :data:`FAULTS_ENV` (a JSON object of this class's fields), if set."""
        text = os.environ.get(FAULTS_ENV, "").strip()
        if not text:
            return None
        obj = json.loads(text)
        if "fail_partitions" in obj and obj["fail_partitions"] is not None:
            obj["fail_partitions"] = tuple(obj["fail_partitions"])
        return cls(**obj)

    def task_fault(self, batch_id: int, partition: int, attempt: int) -> bool:
        """Does this task attempt get the task faults?"""
        if self.task_batch is not None and self.task_batch != batch_id:
            return False
        return self.fail_partitions is None or partition in self.fail_partitions


# ---------------------------------------------------------------------------
# Decision stores
# ---------------------------------------------------------------------------


class DecisionStore(ABC):
    """Durable, append-only storage of :class:`SinkDecision` objects, one file per batch revision.

    ``put`` must be atomic (a reader sees the whole decision or none of it),
    durable before it returns, and must never replace an existing decision.
    """

    @abstractmethod
    def _names(self) -> list[str]:
        """File names in the store directory (empty if it does not exist)."""

    @abstractmethod
    def _read(self, name: str) -> bytes:
        """Content of one file."""

    @abstractmethod
    def _create(self, name: str, data: bytes) -> None:
        """Atomically create ``name`` with ``data``; raise ``FileExistsError`` if it exists."""

    @abstractmethod
    def _delete(self, name: str) -> None:
        """Delete one file (no error if missing)."""

    @property
    @abstractmethod
    def location(self) -> str:
        """Where the decisions live (for messages)."""

    def _index(self) -> dict[int, int]:
        latest: dict[int, int] = {}
        for name in self._names():
            match = _DECISION_FILE_RE.fullmatch(name)
            if match:
                batch, rev = int(match.group(1)), int(match.group(2))
                latest[batch] = max(rev, latest.get(batch, -1))
        return latest

    @staticmethod
    def _name(batch_id: int, revision: int) -> str:
        return f"{batch_id:019d}.{revision:06d}.json"

    def put(self, decision: SinkDecision) -> None:
        """Write ``decision`` durably; ``FileExistsError`` if that batch revision exists."""
        self._create(self._name(decision.batch_id, decision.revision), decision.to_json())

    def get(self, batch_id: int) -> SinkDecision | None:
        """The decision (highest revision) for ``batch_id``, or ``None``."""
        revision = self._index().get(batch_id)
        if revision is None:
            return None
        return SinkDecision.from_json(self._read(self._name(batch_id, revision)))

    def latest(self) -> SinkDecision | None:
        """The decision of the highest batch id, or ``None``."""
        index = self._index()
        if not index:
            return None
        batch_id = max(index)
        return SinkDecision.from_json(self._read(self._name(batch_id, index[batch_id])))

    def purge(self, keep_from_batch: int) -> int:
        """Delete decisions of batches below ``keep_from_batch``; return how many files went."""
        gone = 0
        for name in self._names():
            match = _DECISION_FILE_RE.fullmatch(name)
            if match and int(match.group(1)) < keep_from_batch:
                self._delete(name)
                gone += 1
        return gone


class LocalDecisionStore(DecisionStore):
    """Decisions as files in a local directory: write a temp file, fsync, hard-link into place, fsync the directory.

    ``os.link`` fails if the target exists, so a decision is never replaced,
    and the file appears whole or not at all.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._dir = Path(directory)

    @property
    def location(self) -> str:
        return str(self._dir)

    def _names(self) -> list[str]:
        try:
            return os.listdir(self._dir)
        except FileNotFoundError:
            return []

    def _read(self, name: str) -> bytes:
        return (self._dir / name).read_bytes()

    def _create(self, name: str, data: bytes) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        tmp = self._dir / f".{name}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, self._dir / name)
        finally:
            os.unlink(tmp)
        dir_fd = os.open(self._dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _delete(self, name: str) -> None:
        try:
            os.unlink(self._dir / name)
        except FileNotFoundError:
            pass


class HadoopDecisionStore(DecisionStore):
    """Decisions on any Hadoop-compatible file system (HDFS, S3A, ABFS, GCS), through Spark's JVM.

    Writes a temp file with ``hsync`` then renames it into place; a rename
    onto an existing name fails, so a decision is never replaced.  Use a file
    system whose rename is atomic (HDFS, ABFS) or whose new objects appear
    whole (S3 since 2020, GCS): see ``docs/spark.md``.
    """

    def __init__(self, spark: SparkSession, uri: str) -> None:
        jvm = _jvm(spark)
        self._jvm = jvm
        self._dir = jvm.org.apache.hadoop.fs.Path(uri)
        self._fs = self._dir.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
        self._uri = str(self._fs.makeQualified(self._dir).toString())

    @property
    def location(self) -> str:
        return self._uri

    def _path(self, name: str) -> Any:
        return self._jvm.org.apache.hadoop.fs.Path(self._dir, name)

    def _names(self) -> list[str]:
        if not self._fs.exists(self._dir):
            return []
        return [str(status.getPath().getName()) for status in self._fs.listStatus(self._dir)]

    def _read(self, name: str) -> bytes:
        stream = self._fs.open(self._path(name))
        try:
            return bytes(self._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
        finally:
            stream.close()

    def _create(self, name: str, data: bytes) -> None:
        self._fs.mkdirs(self._dir)
        target = self._path(name)
        if self._fs.exists(target):
            raise FileExistsError(f"{self._uri}/{name}")
        tmp = self._path(f".{name}.{uuid.uuid4().hex}.tmp")
        out = self._fs.create(tmp, False)
        try:
            out.write(bytearray(data))
            out.hsync()
        finally:
            out.close()
        if not self._fs.rename(tmp, target):
            self._fs.delete(tmp, False)
            raise FileExistsError(f"{self._uri}/{name} (rename refused)")

    def _delete(self, name: str) -> None:
        self._fs.delete(self._path(name), False)


# ---------------------------------------------------------------------------
# Executor side
# ---------------------------------------------------------------------------

_control_planes: dict[tuple[tuple[str, str], ...], ControlPlane] = {}
_control_planes_lock = threading.Lock()


def _shared_control_plane(config: Mapping[str, Any]) -> ControlPlane:
    """One coordinator connection per Python worker and cluster, reused by its tasks.

    PySpark reuses worker processes across tasks, so this saves a metadata
    bootstrap per task; the producer itself is created per task on purpose
    (its ``init_transactions`` is what fences other attempts).
    """
    key = tuple(sorted((k, str(v)) for k, v in config.items() if k != "transactional.id"))
    with _control_planes_lock:
        ctrl = _control_planes.get(key)
        if ctrl is None:
            ctrl = _control_planes[key] = ControlPlane(dict(key))
        return ctrl


@dataclass(frozen=True)
class _WriterSpec:
    """Everything a task needs to write its partition; pickled to the executors."""

    producer_config: Mapping[str, Any]
    transactional_id_base: str
    topic: str | None
    columns: tuple[str, ...]
    batch_id: int
    only_partitions: frozenset[int] | None = None
    faults: FaultInjection | None = None

    def transactional_id(self, partition: int) -> str:
        return f"{self.transactional_id_base}-{partition}"


def _open_producer(spec: _WriterSpec, partition: int) -> TwoPhaseCommitProducer:
    config = dict(spec.producer_config)
    config["transactional.id"] = spec.transactional_id(partition)
    producer = TwoPhaseCommitProducer(config, control_plane=_shared_control_plane(config))
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


def _produce_batch(producer: TwoPhaseCommitProducer, spec: _WriterSpec, batch: pa.RecordBatch) -> int:
    """Produce one Arrow record batch; return the number of records."""
    names = batch.schema.names
    values = batch.column(names.index("value")).to_pylist()
    keys = batch.column(names.index("key")).to_pylist() if "key" in names else None
    topics = (
        batch.column(names.index("topic")).to_pylist() if spec.topic is None and "topic" in names else None
    )
    partitions = batch.column(names.index("partition")).to_pylist() if "partition" in names else None
    headers = batch.column(names.index("headers")).to_pylist() if "headers" in names else None
    produce = producer.produce
    if topics is None and partitions is None and headers is None:
        # The common shapes get a loop without per-row dict building (the Python
        # per-record cost is what limits this sink's throughput).
        topic = spec.topic
        if topic is None:
            raise UsageError("no topic column and no topic option")
        if keys is None:
            for value in values:
                try:
                    produce(topic, value)
                except QueueFullError:
                    _produce_one(producer, topic, value=value)
        else:
            for value, key in zip(values, keys):
                try:
                    produce(topic, value, key)
                except QueueFullError:
                    _produce_one(producer, topic, value=value, key=key)
        return len(values)
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
    spec: _WriterSpec, batches: Iterable[pa.RecordBatch], partition: int, attempt: int
) -> PartitionResult | None:
    """Write one partition's rows in one Kafka transaction and prepare it (runs on an executor).

    Returns ``None`` for an empty partition (its producer is initialised, which
    fences older attempts, but no transaction reaches the coordinator).  The
    transaction is left *prepared*: only the driver, once the decision is
    durable, commits it.  On failure the transaction is aborted if possible
    and the exception propagates, so Spark retries the task; a retry's
    ``init_transactions`` fences this attempt and aborts what it left open.
    """
    faults = spec.faults if spec.faults is not None and spec.faults.task_fault(spec.batch_id, partition, attempt) \
        else None
    keep = faults is not None and faults.duplicate_attempt is not None and attempt == 0
    kept: list[pa.RecordBatch] = []
    if spec.only_partitions is not None and partition not in spec.only_partitions:
        for _ in batches:  # a repair run: drain the input, write nothing
            pass
        return None
    records = 0
    started = time.monotonic()
    # Open (init_transactions) before pulling the first rows: the JVM computes the
    # input meanwhile.  (Opening on a helper thread while buffering the first rows
    # measured no faster: the GIL is shared with the Arrow reads.)
    producer = _open_producer(spec, partition)
    open_s = time.monotonic() - started
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if keep and records == 0 and faults is not None and faults.duplicate_attempt == "fences_original":
                _duplicate_attempt(spec, [batch], partition)
            if keep:
                kept.append(batch)
            records += _produce_batch(producer, spec, batch)
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
    if keep and faults is not None and faults.duplicate_attempt == "after_prepare":
        _duplicate_attempt(spec, kept, partition)
    if faults is not None and faults.fail_task_at == "after_prepare" and attempt < faults.fail_task_attempts:
        raise RuntimeError(f"kafka2pc fault injection: task for partition {partition} attempt {attempt} "
                           "fails after prepare")
    return PartitionResult(
        partition, attempt, spec.transactional_id(partition), str(state), records,
        open_s, write_done - started - open_s, prepare_s,
    )


def _duplicate_attempt(spec: _WriterSpec, batches: list[pa.RecordBatch], partition: int) -> None:
    """Testing aid: a second attempt of the same partition, as speculation would run (its result is dropped)."""
    logger.warning("fault injection: duplicate attempt of partition %d", partition)
    producer = _open_producer(spec, partition)
    for batch in batches:
        _produce_batch(producer, spec, batch)
    producer.prepare_transaction()
    producer.close()  # a zombie: prepared and abandoned


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
class _ArrowWriter:
    """The ``mapInArrow`` function: one result row per non-empty partition."""

    spec: _WriterSpec

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
        ("write_s", pa.float64()), ("prepare_s", pa.float64()),
    ])


_RESULT_DDL: Final = (
    "partition int, attempt int, transactional_id string, state string, records long, "
    "open_s double, write_s double, prepare_s double"
)


# ---------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------


class SinkCompletionError(Kafka2pcError):
    """The sink could not complete a batch's decision (the batch fails; a restart retries it)."""


@dataclass
class _Completion:
    committed: int = 0
    strays_aborted: int = 0
    aborted: list[int] = field(default_factory=list)


class KafkaTwoPhaseSink:
    """A ``foreachBatch`` function that writes each micro-batch to Kafka exactly once.

    ``producer_config`` is a confluent-kafka configuration (bootstrap servers,
    security, tuning) used by the executors' producers and the driver's
    coordinator client; ``transactional.id`` is chosen by the sink.  ``topic``
    overrides the ``topic`` column.  ``checkpoint_location`` is the query's
    checkpoint location (found automatically from the running query when
    omitted); decisions live under ``<checkpoint>/kafka2pc/<sink id>/``.
    ``sink_id`` names the sink in its transactional ids
    (``<prefix><sink id>-<partition>``); by default it is derived from the
    checkpoint location, so two queries never share ids.  A micro-batch with
    more than ``max_transactions`` partitions is coalesced to that many: the
    sink uses at most that many transactional ids, reused by every batch
    (each distinct id costs broker memory until
    ``transactional.id.expiration.ms``).

    ``sink.metrics`` holds the last ``metrics_history`` :class:`BatchMetrics`;
    ``sink.last_batch_metrics`` the newest.  Call :meth:`recover` to settle
    leftovers without running a batch, :meth:`close` when the query is done.

    Example::

        sink = KafkaTwoPhaseSink({"bootstrap.servers": "localhost:9092"}, topic="out")
        df.writeStream.foreachBatch(sink).option("checkpointLocation", "/chk/q1").start()
    """

    def __init__(
        self,
        producer_config: Mapping[str, Any],
        *,
        topic: str | None = None,
        checkpoint_location: str | None = None,
        sink_id: str | None = None,
        transactional_id_prefix: str = DEFAULT_PREFIX,
        max_transactions: int = 64,
        decision_store: DecisionStore | None = None,
        decisions_to_retain: int = 100,
        max_repairs: int = 3,
        metrics_history: int = 100,
        faults: FaultInjection | None = None,
    ) -> None:
        config = dict(producer_config)
        if "bootstrap.servers" not in config:
            raise UsageError("producer_config must set 'bootstrap.servers'")
        if "transactional.id" in config:
            raise UsageError("the sink chooses transactional ids: do not set 'transactional.id'")
        if sink_id is not None and not _NAME_RE.fullmatch(sink_id):
            raise UsageError(f"sink_id must match {_NAME_RE.pattern}, not {sink_id!r}")
        if not re.fullmatch(r"[A-Za-z0-9._-]{0,60}", transactional_id_prefix):
            raise UsageError(f"invalid transactional_id_prefix {transactional_id_prefix!r}")
        if max_transactions < 1:
            raise UsageError("max_transactions must be at least 1")
        self._config = config
        self._topic = topic
        self._checkpoint_location = checkpoint_location
        self._sink_id = sink_id
        self._prefix = transactional_id_prefix
        self._max_transactions = max_transactions
        self._store = decision_store
        self._retain = max(2, decisions_to_retain)
        self._max_repairs = max_repairs
        self._faults = faults if faults is not None else FaultInjection.from_env()
        self._metrics: deque[BatchMetrics] = deque(maxlen=max(1, metrics_history))
        self._ctrl: ControlPlane | None = None
        self._txn_timeout_ms: int | None = None
        self._recovered = False
        self._lock = threading.Lock()

    # -- public -----------------------------------------------------------------
    @property
    def sink_id(self) -> str | None:
        """The sink id (known after the first batch when derived from the checkpoint)."""
        return self._sink_id

    @property
    def transactional_id_base(self) -> str:
        """``<prefix><sink id>``; partition ``p`` writes under ``<base>-<p>``."""
        if self._sink_id is None:
            raise UsageError("the sink id is not known before the first batch (pass sink_id=...)")
        return f"{self._prefix}{self._sink_id}"

    @property
    def decision_store(self) -> DecisionStore | None:
        """Where decisions are stored (known after the first batch unless given)."""
        return self._store

    @property
    def metrics(self) -> list[BatchMetrics]:
        """Metrics of the recent batches, oldest first."""
        return list(self._metrics)

    @property
    def last_batch_metrics(self) -> BatchMetrics | None:
        """Metrics of the newest batch."""
        return self._metrics[-1] if self._metrics else None

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        """Write micro-batch ``batch_id`` exactly once (the ``foreachBatch`` entry point)."""
        with self._lock:
            self._run_batch(df, int(batch_id))

    def recover(self, spark: SparkSession | None = None) -> int:
        """Settle every open transaction of this sink with the last durable decision; return how many.

        Runs automatically before the first batch of every driver process.
        """
        if self._store is None or self._sink_id is None:
            if spark is None:
                raise UsageError("recover() needs the SparkSession before the first batch")
            self._bind(spark)
        settled = self._settle_leftovers()
        self._recovered = True
        return settled

    def close(self) -> None:
        """Close the driver's coordinator connections."""
        if self._ctrl is not None:
            self._ctrl.close()
            self._ctrl = None

    # -- one batch -------------------------------------------------------------------
    def _run_batch(self, df: DataFrame, batch_id: int) -> None:
        started = time.monotonic()
        if self._store is None or self._sink_id is None:
            self._bind(df.sparkSession)
        store = self._require_store()
        existing = store.get(batch_id)
        if existing is not None:
            logger.info("batch %d: replayed; decision revision %d exists: completing it, not writing again",
                        batch_id, existing.revision)
            t0 = time.monotonic()
            final, completion, repaired = self._complete_with_repair(df, existing)
            self._recovered = True
            now = time.monotonic()
            self._record(BatchMetrics(
                batch_id, True, sum(t.records for t in final.transactions), len(final.transactions), 0,
                completion.committed, completion.strays_aborted, 0, tuple(repaired), {}, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, now - t0, now - started, now - t0,
            ))
            return
        t0 = time.monotonic()
        leftovers = 0
        if not self._recovered:
            leftovers = self._settle_leftovers()
            self._recovered = True
        settle_s = time.monotonic() - t0
        t1 = time.monotonic()
        results = self._write(df, batch_id)
        write_s = time.monotonic() - t1
        self._crash_point("after_prepare", batch_id)
        t2 = time.monotonic()
        decision = SinkDecision(
            self._require_sink_id(), batch_id, 0,
            tuple(SinkTransaction(r.partition, r.transactional_id, r.state, r.records) for r in results),
            int(time.time() * 1000),
        )
        store.put(decision)
        decision_s = time.monotonic() - t2
        self._crash_point("after_decision", batch_id)
        t3 = time.monotonic()
        final, completion, repaired = self._complete_with_repair(df, decision)
        now = time.monotonic()
        if batch_id % 10 == 0:
            self._purge(batch_id)
        self._record(BatchMetrics(
            batch_id, False, sum(t.records for t in final.transactions), len(final.transactions), len(results),
            completion.committed, completion.strays_aborted, leftovers, tuple(repaired),
            {r.partition: r.attempt for r in results}, settle_s, write_s,
            max((r.open_s for r in results), default=0.0), max((r.write_s for r in results), default=0.0),
            max((r.prepare_s for r in results), default=0.0), decision_s, now - t3,
            now - started, now - t2,
        ))

    def _write(
        self, df: DataFrame, batch_id: int, only_partitions: frozenset[int] | None = None
    ) -> list[PartitionResult]:
        columns = self._columns(df)
        spec = _WriterSpec(
            producer_config=self._executor_config(), transactional_id_base=self.transactional_id_base,
            topic=self._topic, columns=columns, batch_id=batch_id, only_partitions=only_partitions,
            faults=self._faults if only_partitions is None else None,
        )
        writer: Any = _ArrowWriter(spec)
        rows = df.select(*columns).coalesce(self._max_transactions).mapInArrow(writer, _RESULT_DDL).collect()
        results = sorted(
            (PartitionResult(**{name: row[name] for name in _RESULT_COLUMNS}) for row in rows),
            key=lambda r: r.partition,
        )
        seen = [r.partition for r in results]
        if len(seen) != len(set(seen)):  # Spark returns one result per partition; never trust blindly
            raise SinkCompletionError(f"batch {batch_id}: more than one result for a partition: {seen}")
        return results

    def _complete_with_repair(
        self, df: DataFrame, decision: SinkDecision
    ) -> tuple[SinkDecision, _Completion, list[int]]:
        repaired: list[int] = []
        total = _Completion()
        for round_ in range(self._max_repairs + 1):
            completion = self._complete(decision)
            total.committed += completion.committed
            total.strays_aborted += completion.strays_aborted
            if not completion.aborted:
                return decision, total, repaired
            if round_ == self._max_repairs:
                break
            lost = frozenset(completion.aborted)
            logger.warning(
                "batch %d: Kafka aborted the decided transactions of partitions %s (a late task attempt "
                "re-initialised the id, or the transaction timed out): writing them again",
                decision.batch_id, sorted(lost),
            )
            results = {r.partition: r for r in self._write(df, decision.batch_id, only_partitions=lost)}
            if set(results) != set(lost):
                raise SinkCompletionError(
                    f"batch {decision.batch_id}: repair of partitions {sorted(lost)} returned {sorted(results)}; "
                    "the batch's input is not deterministic"
                )
            decision = SinkDecision(
                decision.sink_id, decision.batch_id, decision.revision + 1,
                tuple(
                    SinkTransaction(t.partition, t.transactional_id, results[t.partition].state,
                                    results[t.partition].records)
                    if t.partition in results else t
                    for t in decision.transactions
                ),
                int(time.time() * 1000),
            )
            self._require_store().put(decision)
            repaired.extend(sorted(lost))
        raise SinkCompletionError(
            f"batch {decision.batch_id}: partitions {completion.aborted} still aborted after "
            f"{self._max_repairs} repairs"
        )

    def _complete(self, decision: SinkDecision) -> _Completion:
        """Commit every transaction the decision names; abort every other open one of this sink."""
        ctrl = self._control_plane()
        result = _Completion()
        unknown: list[SinkTransaction] = []
        ended: list[str] = []
        for i, txn in enumerate(decision.transactions):
            settlement = settle(ctrl, txn.transactional_id, txn.prepared_state, raise_on_heuristic=False)
            if settlement.plan.decision is not Decision.NOTHING:
                ended.append(txn.transactional_id)
            if settlement.outcome is TransactionOutcome.COMMITTED:
                result.committed += 1
            elif settlement.outcome is TransactionOutcome.ABORTED:
                result.aborted.append(txn.partition)
            elif settlement.outcome is not TransactionOutcome.NONE:
                unknown.append(txn)
            if i == 0:
                self._crash_point("mid_completion", decision.batch_id)
        self._await_markers(ended)
        result.strays_aborted = self._settle_open(decision.by_transactional_id())
        deadline = time.monotonic() + 60
        while unknown:
            # The last stable offset was held back (e.g. by a stray we just aborted): ask again.
            pending = []
            for txn in unknown:
                outcome = outcome_of(ctrl, txn.prepared_state)
                if outcome is TransactionOutcome.COMMITTED:
                    result.committed += 1
                elif outcome is TransactionOutcome.ABORTED:
                    result.aborted.append(txn.partition)
                else:
                    pending.append(txn)
            unknown = pending
            if unknown and time.monotonic() > deadline:
                raise SinkCompletionError(
                    f"batch {decision.batch_id}: the outcome of {[t.state for t in unknown]} stays unknown"
                )
            if unknown:
                time.sleep(0.5)
        return result

    def _await_markers(self, transactional_ids: Iterable[str], timeout_s: float = 10.0) -> None:
        """Wait until the coordinator has written the commit markers of what we just ended.

        EndTxn answers once the decision is logged (``PrepareCommit``); the
        markers that make the records readable follow.  Waiting here makes
        ``time_to_visibility_s`` honest, and it spares the next batch's tasks:
        an ``init_transactions`` that arrives during ``PrepareCommit`` gets
        CONCURRENT_TRANSACTIONS, and librdkafka retries only after about 0.5 s.
        """
        ctrl = self._control_plane()
        deadline = time.monotonic() + timeout_s
        for tid in transactional_ids:
            while True:
                desc = ctrl.describe_transaction(tid)
                if desc is None or desc.state not in ("PrepareCommit", "PrepareAbort"):
                    break
                if time.monotonic() > deadline:
                    logger.warning("%s still %s after %.0fs", tid, desc.state, timeout_s)
                    break
                time.sleep(0.005)

    def _settle_open(self, named: Mapping[str, SinkTransaction]) -> int:
        """Settle every open transaction under this sink's ids: commit it if ``named`` names it, else abort it.

        A transaction no decision names (a crashed run's, a zombie attempt's)
        is aborted with KIP-939's ``forceTerminateTransaction`` (InitProducerId),
        which also bumps the epoch and so fences a zombie producer still
        running.  Returns how many transactions were aborted.
        """
        ctrl = self._control_plane()
        pattern = re.compile(re.escape(self.transactional_id_base) + r"-(\d+)")
        aborted = 0
        for listing in ctrl.list_transactions(states=["Ongoing"]):
            tid = listing.transactional_id
            if not pattern.fullmatch(tid):
                continue
            txn = named.get(tid)
            if txn is not None:
                settlement = settle(ctrl, tid, txn.prepared_state, raise_on_heuristic=False)
                logger.info("settled open transaction of %s: %s (%s)", tid, settlement.plan.decision.value,
                            settlement.plan.reason)
                if settlement.plan.decision is Decision.ABORT:
                    aborted += 1
                continue
            desc = ctrl.describe_transaction(tid)
            if desc is None or desc.state != "Ongoing":
                continue
            ctrl.init_producer_id(tid, transaction_timeout_ms=desc.timeout_ms if desc.timeout_ms > 0 else 60_000)
            aborted += 1
            logger.info("aborted and fenced the undecided transaction of %s (producer %d, epoch %d)",
                        tid, desc.producer_id, desc.producer_epoch)
        return aborted

    def _settle_leftovers(self) -> int:
        """Before writing anything: commit what the last decision names, abort every other open transaction."""
        latest = self._require_store().latest()
        return self._settle_open(latest.by_transactional_id() if latest is not None else {})

    # -- helpers ---------------------------------------------------------------
    def _bind(self, spark: SparkSession) -> None:
        """Resolve the checkpoint location, the sink id and the decision store (first batch)."""
        if self._store is not None and self._sink_id is not None:
            return
        checkpoint = self._resolve_checkpoint(spark)
        if self._sink_id is None:
            self._sink_id = "q" + hashlib.sha256(checkpoint.encode()).hexdigest()[:16]
        if self._store is None:
            directory = f"{checkpoint.rstrip('/')}/kafka2pc/{self._sink_id}"
            if directory.startswith("file:"):
                self._store = LocalDecisionStore(_local_path(directory))
            else:
                self._store = HadoopDecisionStore(spark, directory)
        logger.info("sink %s: transactional ids %s-<partition>, decisions in %s", self._sink_id,
                    self.transactional_id_base, self._store.location)

    def _resolve_checkpoint(self, spark: SparkSession) -> str:
        running = _running_query_checkpoint(spark)
        if self._checkpoint_location is None:
            if running is None:
                raise UsageError(
                    "cannot find the query's checkpoint location: pass checkpoint_location=... (the same "
                    "path as the query's checkpointLocation option)"
                )
            return running
        given = _qualify(spark, self._checkpoint_location)
        if running is not None and running.rstrip("/") != given.rstrip("/"):
            raise UsageError(
                f"checkpoint_location={self._checkpoint_location!r} ({given}) is not the running query's "
                f"checkpoint location {running}: decisions must live with the query's checkpoint"
            )
        return given

    def _columns(self, df: DataFrame) -> tuple[str, ...]:
        fields = {f.name: f.dataType.simpleString() for f in df.schema.fields}
        if "value" not in fields:
            raise UsageError(f"the batch has no 'value' column (columns: {sorted(fields)})")
        allowed = {
            "value": {"string", "binary"}, "key": {"string", "binary"}, "topic": {"string"},
            "partition": {"int"}, "headers": {"array<struct<key:string,value:binary>>"},
        }
        columns = []
        for name, types in allowed.items():
            if name not in fields:
                continue
            if fields[name] not in types:
                raise UsageError(f"column {name!r} has type {fields[name]}; expected one of {sorted(types)}")
            if name == "topic" and self._topic is not None:
                continue  # the option overrides the column, as in Spark's Kafka sink
            columns.append(name)
        if self._topic is None and "topic" not in fields:
            raise UsageError("no 'topic' column and no topic option: where should the rows go?")
        return tuple(columns)

    def _executor_config(self) -> dict[str, Any]:
        config = dict(self._config)
        if "transaction.timeout.ms" not in config and "transaction.two.phase.commit.enable" not in config:
            if self._txn_timeout_ms is None:
                limit = self._control_plane().broker_config(["transaction.max.timeout.ms"]).get(
                    "transaction.max.timeout.ms"
                )
                # Within librdkafka's limit (see LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS).
                self._txn_timeout_ms = (
                    min(int(limit), LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS) if limit else 900_000
                )
            config["transaction.timeout.ms"] = self._txn_timeout_ms
        # Every task opens a fresh producer, so init_transactions is on every
        # task's path.  With sparse connections librdkafka drops the bootstrap
        # connection once metadata names the broker and often reaches the
        # coordinator only on its 500 ms retry timer (measured: 55-510 ms per
        # init); with eager connections it takes 3-5 ms.  socket.timeout.ms
        # follows the transaction timeout (found while a 1 h timeout still made
        # librdkafka's requests time out at once; the cap above is the cure).
        if "enable.sparse.connections" not in config:
            config["enable.sparse.connections"] = False
            if "socket.timeout.ms" not in config:
                txn_timeout = int(config.get("transaction.timeout.ms", 60_000))
                config["socket.timeout.ms"] = max(1_000, min(60_000, txn_timeout - 100))
        return config

    def _control_plane(self) -> ControlPlane:
        if self._ctrl is None:
            self._ctrl = ControlPlane(self._config)
        return self._ctrl

    def _require_store(self) -> DecisionStore:
        if self._store is None:
            raise UsageError("the sink is not bound to a checkpoint yet")
        return self._store

    def _require_sink_id(self) -> str:
        if self._sink_id is None:
            raise UsageError("the sink id is not known yet")
        return self._sink_id

    def _purge(self, batch_id: int) -> None:
        try:
            gone = self._require_store().purge(batch_id - self._retain)
            if gone:
                logger.debug("purged %d old decisions", gone)
        except Exception as exc:  # noqa: BLE001 - purging is housekeeping; never fail a batch for it
            logger.warning("could not purge old decisions: %s", exc)

    def _record(self, metrics: BatchMetrics) -> None:
        self._metrics.append(metrics)
        logger.info(
            "batch %d%s: %d records in %d transactions (%d committed, %d strays aborted, repaired %s); "
            "write %.3fs, decision %.3fs, completion %.3fs, visible after %.3fs",
            metrics.batch_id, " (replay)" if metrics.replayed else "", metrics.records, metrics.partitions,
            metrics.transactions_committed, metrics.stray_transactions_aborted,
            list(metrics.repaired_partitions) or "none", metrics.write_s, metrics.decision_s,
            metrics.completion_s, metrics.time_to_visibility_s,
        )

    def _crash_point(self, name: str, batch_id: int) -> None:
        faults = self._faults
        if faults is None or faults.crash_at != name:
            return
        if faults.crash_batch is not None and faults.crash_batch != batch_id:
            return
        logger.warning("fault injection: driver crash at %s of batch %d", name, batch_id)
        if faults.crash_marker:
            Path(faults.crash_marker).write_text(f"{name} {batch_id}\n")
            while True:  # wait for the test to SIGKILL the process group (JVM included)
                time.sleep(60)
        os.kill(os.getpid(), signal.SIGKILL)


def _running_query_checkpoint(spark: SparkSession) -> str | None:
    """The resolved checkpoint root of the streaming query calling us (``None`` outside one)."""
    try:
        query_id = spark.sparkContext.getLocalProperty("sql.streaming.queryId")
        if not query_id:
            return None
        from pyspark.sql import SparkSession as _Session

        sessions = [spark, _Session.getActiveSession()]
        for session in sessions:
            if session is None:
                continue
            wrapper = session._jsparkSession.streams().get(query_id)
            if wrapper is not None:
                return str(wrapper.streamingQuery().resolvedCheckpointRoot())
    except Exception as exc:  # noqa: BLE001 - an API change in Spark: fall back to the explicit option
        logger.debug("could not find the running query's checkpoint: %s", exc)
    return None


def _jvm(spark: SparkSession) -> Any:
    jvm = spark.sparkContext._jvm
    if jvm is None:
        raise UsageError("the SparkContext has no JVM gateway (stopped, or Spark Connect)")
    return jvm


def _qualify(spark: SparkSession, location: str) -> str:
    jvm = _jvm(spark)
    path = jvm.org.apache.hadoop.fs.Path(location)
    fs = path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    return str(fs.makeQualified(path).toString())


def _local_path(uri: str) -> str:
    from urllib.parse import unquote, urlparse

    return unquote(urlparse(uri).path)

