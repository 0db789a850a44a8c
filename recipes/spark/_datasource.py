"""``format("kafka2pc")``: exactly-once batch and streaming writes to Kafka through Spark's writer API (PySpark 4).

Register once per SparkSession (and in each Python thread that writes), then
write as to Spark's Kafka sink::

    from kafka2pc.recipes.spark import register_data_source

    register_data_source(spark)
    (df.selectExpr("CAST(id AS STRING) AS key", "payload AS value")
       .write.format("kafka2pc")
       .option("kafka.bootstrap.servers", "broker:9092")
       .option("topic", "out")
       .option("kafka2pc.runId", "2026-11-25")        # a rerun with this id writes nothing
       .option("kafka2pc.decisionPath", "/data/kafka2pc")
       .save())

    (stream.writeStream.format("kafka2pc")
       .option("kafka.bootstrap.servers", "broker:9092")
       .option("topic", "out")
       .option("checkpointLocation", "/chk/q1")
       .start())

PySpark also finds it without the call when the ``pyspark_kafka2pc`` module
is installed (PySpark looks up ``pyspark_*`` modules' ``DefaultSource``);
:func:`register_data_source` also brings the driver-side log lines and each
batch's metrics into the driver's Python and lets a ``local[*]`` session keep
batch decisions in the default directory.

Options: ``kafka.bootstrap.servers`` (required) and any ``kafka.<setting>``
(passed to librdkafka without the prefix; not ``transactional.id``),
``topic`` (overrides the ``topic`` column), and:

- ``kafka2pc.runId`` (batch): the identity of the job run.  A second write
  with the same run id, after the first committed, writes nothing and logs
  so; a run that died half-way is completed or aborted as its recorded
  decision says, then the rerun writes exactly once.  Without it every
  batch write is a new run.
- ``kafka2pc.decisionPath``: a directory on the driver (local or a mounted
  shared file system) where decisions live, in one folder per query or run
  (``<sink id>``).  Streaming: default ``<checkpointLocation>/kafka2pc``;
  batch: required, except on a ``local[*]`` session registered with
  :func:`register_data_source` (default ``~/.kafka2pc/spark``).
- ``kafka2pc.decisionsToRetain`` (default 100), ``kafka2pc.maxRepairs``
  (default 3), ``kafka2pc.transactionalIdPrefix`` (default ``kafka2pc-spark-``).

The input columns are Spark's Kafka sink's: ``value`` (required), ``key``,
``topic``, ``partition``, ``headers``.  Each Spark partition of a write is
one Kafka transaction under its own transactional id per task attempt;
repartition or coalesce the DataFrame to bound how many.  The protocol is the
``foreachBatch`` sink's (:mod:`kafka2pc.recipes.spark`): tasks write and
prepare, the driver records the decision and completes it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

from kafka2pc._extras import missing_extra

try:
    from pyspark.sql.datasource import DataSource, WriterCommitMessage
except ImportError as exc:  # pragma: no cover - PySpark 3.5, or no PySpark
    try:
        import pyspark  # noqa: F401
    except ImportError as missing:
        raise missing_extra(missing, extra="spark", feature="format('kafka2pc')") from missing
    raise ImportError(
        "format('kafka2pc') needs PySpark 4's Python data sources (pyspark.sql.datasource); on PySpark 3.5 "
        "use the foreachBatch sink, kafka2pc.recipes.spark.KafkaTwoPhaseSink"
    ) from exc

from kafka2pc import TransactionAdmin, UsageError

from ._config import default_transaction_timeout_ms, executor_config, schema_columns
from ._executor import TaskHook, WriterSpec, attempt_transactional_id, shared_admin, write_partition
from ._options import Options, check_reachable, is_local_master, location
from ._protocol import Completed, SinkCoordinator
from ._relay import DataSourceMonitor, RelayClient, monitor, relayed
from ._session import is_connect, master
from ._store import LocalDecisionStore
from ._values import (
    BatchMetrics,
    PartitionResult,
    SinkCompletionError,
    SinkDecision,
    SinkStepHook,
    UnknownTopicError,
)

# Arrow writers where this PySpark has them (tasks then get pyarrow.RecordBatches); Rows otherwise.
try:
    from pyspark.sql.datasource import DataSourceArrowWriter as _BatchWriterBase
except ImportError:  # pragma: no cover - depends on the PySpark line
    from pyspark.sql.datasource import DataSourceWriter as _BatchWriterBase  # type: ignore[assignment]
try:
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _StreamWriterBase
except ImportError:  # pragma: no cover - depends on the PySpark line
    from pyspark.sql.datasource import DataSourceStreamWriter as _StreamWriterBase  # type: ignore[assignment]

_ROWS_PER_ARROW_BATCH: Final = 10_000

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

logger = logging.getLogger("kafka2pc.recipes.spark_sink")

NAME: Final = "kafka2pc"
"""The data source's format name."""

_SLOTS: Final = 8


def register_data_source(spark: SparkSession) -> DataSourceMonitor:
    """Register ``format("kafka2pc")`` with ``spark`` for this Python thread; return the driver's monitor.

    On a classic session PySpark looks a Python data source up through the
    JVM's *active* session, which is per thread: call this in every Python
    thread that writes with ``format("kafka2pc")`` (a thread that did not gets
    ``DATA_SOURCE_NOT_FOUND``).  On a Spark Connect session the registration
    is the server-side session's, so every thread of the client that uses
    ``spark`` finds it.  Idempotent and cheap.  The source it registers sends
    its driver-side log records (e.g. a rerun's "run ... was committed
    already") to this process's ``logging``, and each batch's
    :class:`BatchMetrics` to the returned :class:`DataSourceMonitor` (one per
    process); on Connect only when the server runs on this host.  Example::

        register_data_source(spark)
        df.write.format("kafka2pc").option("kafka.bootstrap.servers", "b:9092").option("topic", "t").save()
    """
    driver_monitor, address = monitor()
    url = master(spark)
    registered = type("_RegisteredKafka2pcDataSource", (Kafka2pcDataSource,), {
        "_relay_address": address, "_local_master": None if url is None else is_local_master(url),
        "__module__": __name__, "__doc__": Kafka2pcDataSource.__doc__,
    })
    spark.dataSource.register(registered)
    if not is_connect(spark):  # this thread's JVM thread looks data sources up through it
        gateway = spark.sparkContext._jvm
        if gateway is not None:
            gateway.SparkSession.setActiveSession(spark._jsparkSession)
    return driver_monitor


@dataclass(frozen=True)
class _Plan:
    """What the driver decided for one write: ids, decision directory, settings; pickled to the tasks."""

    spec: WriterSpec
    sink_id: str
    directory: str
    slot: int
    streaming: bool
    max_repairs: int
    retain: int
    admin_config: Mapping[str, Any]
    relay: str | None = None
    """The driver's relay (logs and metrics of the driver-side calls), if registered by ``register_data_source``."""
    skip: bool = False
    """Batch: the run id's decision is complete, write nothing."""
    leftovers_aborted: int = 0
    settle_s: float = 0.0

    def coordinator(self, admin: TransactionAdmin, on_step: SinkStepHook | None) -> SinkCoordinator:
        return SinkCoordinator(lambda: admin, self.sink_id, self.spec.transactional_id_base,
                               LocalDecisionStore(self.directory), max_repairs=self.max_repairs,
                               decisions_to_retain=self.retain, on_step=on_step)


@dataclass(frozen=True)
class _Prepared(WriterCommitMessage):
    """A task's commit message: its prepared transaction (``None`` for an empty partition or a skipped run)."""

    result: PartitionResult | None


class Kafka2pcDataSource(DataSource):
    """The ``kafka2pc`` data source: exactly-once ``write`` and ``writeStream`` to Kafka (see the module doc).

    Register it with :func:`register_data_source`.
    """

    _on_step: ClassVar[SinkStepHook | None] = None
    """Private test seam: a driver hook called at each :class:`~kafka2pc.recipes.spark.SinkStep` (subclass to set)."""
    _task_hook: ClassVar[TaskHook | None] = None
    """Private test seam: a task hook called at each ``TaskStep`` (subclass to set)."""
    _relay_address: ClassVar[str | None] = None
    """Set by :func:`register_data_source`: the driver process's relay."""
    _local_master: ClassVar[bool | None] = None
    """Set by :func:`register_data_source`: is the session's master ``local[*]`` (``None``: unknown)."""

    @classmethod
    def name(cls) -> str:
        """``"kafka2pc"``."""
        return NAME

    def writer(self, schema: StructType, overwrite: bool) -> Kafka2pcBatchWriter:
        """The batch writer (called once on the driver before the tasks): settles the run's leftovers first."""
        return Kafka2pcBatchWriter(self._plan(schema, streaming=False), type(self)._on_step)

    def streamWriter(self, schema: StructType, overwrite: bool) -> Kafka2pcStreamWriter:  # noqa: N802 - PySpark's name
        """The micro-batch writer (read-only here: Spark also builds one for every commit)."""
        return Kafka2pcStreamWriter(self._plan(schema, streaming=True), type(self)._on_step)

    def _plan(self, schema: StructType, *, streaming: bool) -> _Plan:
        cls = type(self)
        with relayed(cls._relay_address):
            opts = Options.parse(self.options)
            columns = schema_columns(schema, opts.topic)
            sink_id, directory = location(opts, streaming=streaming, local_master=cls._local_master)
            check_reachable(opts.config)  # a refused bootstrap fails now, naming it, not after 30 s
            admin = shared_admin(opts.config)  # the commit that follows in this worker reuses it
            if opts.topic is not None and opts.topic not in admin.topic_names():
                raise UnknownTopicError(f"topic {opts.topic!r} (the topic option) does not exist")
            limit = None
            if ("transaction.timeout.ms" not in opts.config
                    and "transaction.two.phase.commit.enable" not in opts.config):
                limit_s = admin.max_transaction_timeout_s()
                limit = default_transaction_timeout_ms(None if limit_s is None else round(limit_s * 1000))
            spec = WriterSpec(executor_config(opts.config, limit), f"{opts.prefix}{sink_id}", opts.topic, columns,
                              batch_id=0, task_hook=cls._task_hook)
            plan = _Plan(spec, sink_id, directory, 0, streaming, opts.max_repairs, opts.retain, dict(opts.config),
                         relay=cls._relay_address)
            latest = LocalDecisionStore(directory).latest()
            plan = dataclasses.replace(plan, slot=_free_slot(latest))
            if not streaming:
                plan = _settle_run(plan, admin, opts.run_id, cls._on_step)
            return plan


def _free_slot(latest: SinkDecision | None) -> int:
    """The lowest id slot the latest decision does not use (its transactions may still be open)."""
    used = set()
    for txn in latest.transactions if latest is not None else ():
        parts = txn.transactional_id.rsplit("-", 1)[-1].split(".")
        used.add(int(parts[1]) if len(parts) == 3 else 0)
    for slot in range(_SLOTS):
        if slot not in used:
            return slot
    raise SinkCompletionError(f"the latest decision uses every transactional id slot: {sorted(used)}")


def _settle_run(plan: _Plan, admin: TransactionAdmin, run_id: str | None, on_step: SinkStepHook | None) -> _Plan:
    """Batch, before the tasks: complete the run's recorded decision, or abort what a died run left open."""
    started = time.monotonic()
    coordinator = plan.coordinator(admin, on_step)
    existing = coordinator.store.get(0)
    if existing is None:
        aborted = coordinator.settle_leftovers().aborted
        if aborted:
            logger.warning("run %s: aborted %d transactions a previous attempt of the run left open", run_id, aborted)
        return dataclasses.replace(plan, leftovers_aborted=aborted, settle_s=time.monotonic() - started)
    done = coordinator.complete(existing, None)
    if done.completion.aborted:
        logger.warning("run %s: Kafka aborted the decided transactions of partitions %s: the rerun writes them "
                       "again", run_id, done.completion.aborted)
        return dataclasses.replace(plan, settle_s=time.monotonic() - started)
    logger.warning(
        "run %s was committed already (%d records in %d transactions, decision %s): this write writes nothing",
        run_id, sum(t.records for t in existing.transactions), len(existing.transactions), coordinator.store.location,
    )
    return dataclasses.replace(plan, skip=True, settle_s=time.monotonic() - started)


def _write_task(plan: _Plan, batches: Iterator[pa.RecordBatch]) -> _Prepared:
    """One task: write and prepare its partition under its attempt's transactional id."""
    from pyspark import TaskContext

    if plan.skip:
        return _Prepared(None)
    ctx = TaskContext.get()
    if ctx is None:
        raise UsageError("the kafka2pc writer must run inside a Spark task")
    spec = plan.spec
    if plan.streaming:
        spec = dataclasses.replace(spec, batch_id=int(ctx.getLocalProperty("streaming.sql.batchId") or 0))
    partition = ctx.partitionId()
    tid = attempt_transactional_id(spec.transactional_id_base, partition, plan.slot, ctx.attemptNumber())
    return _Prepared(write_partition(spec, _arrow(batches), partition, ctx.attemptNumber(), tid))


def _arrow(items: Iterator[Any]) -> Iterator[pa.RecordBatch]:
    """Arrow record batches from an Arrow writer's input, or from a Row writer's (PySpark lines without one)."""
    import pyarrow as pa

    rows: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, pa.RecordBatch):
            yield item
            continue
        rows.append(item.asDict(recursive=True))
        if len(rows) >= _ROWS_PER_ARROW_BATCH:
            yield pa.RecordBatch.from_pylist(rows)
            rows = []
    if rows:
        yield pa.RecordBatch.from_pylist(rows)


def _commit(plan: _Plan, on_step: SinkStepHook | None, messages: Sequence[WriterCommitMessage | None],
            batch_id: int) -> Completed | None:
    """The driver's commit: record the decision and complete it; a replayed batch completes its recorded one."""
    with relayed(plan.relay) as relay:
        return _commit_batch(plan, on_step, messages, batch_id, relay)


def _commit_batch(plan: _Plan, on_step: SinkStepHook | None, messages: Sequence[WriterCommitMessage | None],
                  batch_id: int, relay: RelayClient | None) -> Completed | None:
    started = time.monotonic()
    results = sorted((m.result for m in messages if isinstance(m, _Prepared) and m.result is not None),
                     key=lambda r: r.partition)
    if plan.skip:
        return None  # _settle_run said so
    admin = shared_admin(plan.admin_config)
    coordinator = plan.coordinator(admin, on_step)
    existing = coordinator.store.get(batch_id)
    decision_s = 0.0
    if existing is None:
        decision = coordinator.decide(batch_id, results, fingerprints=False)
        decision_s = time.monotonic() - started
        done = coordinator.complete(decision, None)
    else:
        logger.info("batch %d: decision revision %d exists: completing it (the replay's transactions are "
                    "aborted unless a repair needs them)", batch_id, existing.revision)

        def rewrite(decision: SinkDecision, lost: frozenset[int], whole: bool) -> list[PartitionResult]:
            return results

        done = coordinator.complete(existing, rewrite, keep=frozenset(r.transactional_id for r in results))
    if done.completion.aborted:
        raise SinkCompletionError(
            f"batch {batch_id}: Kafka aborted the decided transactions of partitions {done.completion.aborted} "
            "(the transaction timed out, or an operator aborted it); a replay repairs them: restart the "
            "query or rerun the job"
        )
    coordinator.purge(batch_id)
    logger.info("batch %d: %d records in %d transactions committed (%d strays aborted, repaired %s)", batch_id,
                sum(t.records for t in done.decision.transactions), done.completion.committed,
                done.completion.strays_aborted, done.repaired or "none")
    if relay is not None:
        relay.send_batch(_batch_metrics(plan, batch_id, existing is not None, results, done, started, decision_s))
    return done


def _batch_metrics(plan: _Plan, batch_id: int, replayed: bool, results: Sequence[PartitionResult],
                   done: Completed, started: float, decision_s: float) -> BatchMetrics:
    """The :class:`BatchMetrics` of one committed batch, as the ``foreachBatch`` sink reports its own.

    The driver does not see the write job start: ``write_s`` is the slowest
    task's (open, write and prepare), and the time to visibility adds it to
    the commit's time up to the last commit.
    """
    now = time.monotonic()
    visible = done.completion.visible_at or now
    write_s = max((r.open_s + r.write_s + r.prepare_s for r in results), default=0.0)
    prepared = [r for r in results if r.written]
    return BatchMetrics(
        batch_id, replayed, sum(t.records for t in done.decision.transactions), len(done.decision.transactions),
        0 if replayed else len(prepared), done.completion.committed, done.completion.strays_aborted,
        plan.leftovers_aborted, tuple(done.repaired), {r.partition: r.attempt for r in results}, plan.settle_s,
        write_s, max((r.open_s for r in results), default=0.0), max((r.write_s for r in results), default=0.0),
        max((r.prepare_s for r in results), default=0.0), decision_s, now - started - decision_s,
        write_s + (visible - started), visible - started, sink_id=plan.sink_id,
    )


def _abort(plan: _Plan, batch_id: int) -> None:
    """A failed write: abort every transaction no decision names (the tasks' prepared ones)."""
    with relayed(plan.relay):
        plan.coordinator(shared_admin(plan.admin_config), None).abort_undecided(batch_id)


class Kafka2pcBatchWriter(_BatchWriterBase):
    """The batch writer of ``format("kafka2pc")``: Arrow batches in, one prepared transaction per task."""

    def __init__(self, plan: _Plan, on_step: SinkStepHook | None) -> None:
        self._plan = plan
        self._on_step = on_step

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        """Write and prepare this task's partition (on an executor)."""
        return _write_task(self._plan, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Every task succeeded: record the decision and commit (on the driver)."""
        _commit(self._plan, self._on_step, messages, 0)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """A task failed for good: abort what the tasks prepared (on the driver)."""
        _abort(self._plan, 0)


class Kafka2pcStreamWriter(_StreamWriterBase):
    """The micro-batch writer of ``writeStream.format("kafka2pc")``: each batch exactly once."""

    def __init__(self, plan: _Plan, on_step: SinkStepHook | None) -> None:
        self._plan = plan
        self._on_step = on_step

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        """Write and prepare this task's partition of the micro-batch (on an executor)."""
        return _write_task(self._plan, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        """Every task succeeded: record the decision for ``batchId`` and commit (on the driver)."""
        _commit(self._plan, self._on_step, messages, batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        """A task failed for good: abort what the micro-batch's tasks prepared (on the driver)."""
        _abort(self._plan, batchId)
