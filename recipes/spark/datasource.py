"""``format("kafka2pc")``: exactly-once batch and streaming writes to Kafka through Spark's writer API (PySpark 4).

Register once per SparkSession, then write as to Spark's Kafka sink::

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
is installed (PySpark looks up ``pyspark_*`` modules' ``DefaultSource``).

Options: ``kafka.bootstrap.servers`` (required) and any ``kafka.<setting>``
(passed to librdkafka without the prefix; not ``transactional.id``),
``topic`` (overrides the ``topic`` column), and:

- ``kafka2pc.runId`` (batch): the identity of the job run.  A second write
  with the same run id, after the first committed, writes nothing and logs
  so; a run that died half-way is completed or aborted as its recorded
  decision says, then the rerun writes exactly once.  Without it every
  batch write is a new run.
- ``kafka2pc.decisionPath``: a directory on the driver (local or a mounted
  shared file system) where decisions live.  Streaming: default
  ``<checkpointLocation>/kafka2pc``; batch: default ``~/.kafka2pc/spark``.
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
import hashlib
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

try:
    from pyspark.sql.datasource import DataSource, WriterCommitMessage
except ImportError as exc:  # pragma: no cover - PySpark 3.5
    raise ImportError(
        "format('kafka2pc') needs PySpark 4's Python data sources (pyspark.sql.datasource); on PySpark 3.5 "
        "use the foreachBatch sink, kafka2pc.recipes.spark.KafkaTwoPhaseSink"
    ) from exc

from kafka2pc import TransactionAdmin, UsageError

from ._config import default_transaction_timeout_ms, executor_config, schema_columns
from ._executor import TaskHook, WriterSpec, attempt_transactional_id, shared_admin, write_partition
from ._protocol import Completed, SinkCoordinator
from ._session import local_path
from ._store import LocalDecisionStore
from ._values import PartitionResult, SinkCompletionError, SinkDecision, StepHook, UnknownTopicError

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

_DEFAULT_PREFIX: Final = "kafka2pc-spark-"
_SLOTS: Final = 8
_NAME_RE: Final = re.compile(r"[A-Za-z0-9._-]{0,60}")


def register_data_source(spark: SparkSession) -> None:
    """Register ``format("kafka2pc")`` with ``spark`` (PySpark 4; idempotent).

    Example::

        register_data_source(spark)
        df.write.format("kafka2pc").option("kafka.bootstrap.servers", "b:9092").option("topic", "t").save()
    """
    spark.dataSource.register(Kafka2pcDataSource)


def recover(options: Mapping[str, str]) -> int:
    """Settle what a stopped or failed write left open, as its next run would; return how many were aborted.

    ``options`` are the write's own (``kafka.bootstrap.servers`` and the
    ``kafka.*`` settings, and ``checkpointLocation`` for a streaming query or
    ``kafka2pc.runId`` for a batch run, with ``kafka2pc.decisionPath`` where
    it was set).  What the last decision names is committed, everything else
    under the write's transactional ids is aborted.  Call it from any driver
    process, e.g. after a query failed::

        recover({"kafka.bootstrap.servers": "b:9092", "checkpointLocation": "/chk/q1"})
    """
    opts = _Options.parse(options)
    if opts.run_id is None and opts.checkpoint is None and opts.decision_path is None:
        raise UsageError("recover() needs the write's checkpointLocation (streaming) or kafka2pc.runId (batch)")
    sink_id, directory = _location(opts, streaming=opts.run_id is None)
    with TransactionAdmin(dict(opts.config)) as admin:
        coordinator = SinkCoordinator(lambda: admin, sink_id, f"{opts.prefix}{sink_id}", LocalDecisionStore(directory))
        return coordinator.settle_leftovers()


def _location(opts: _Options, *, streaming: bool) -> tuple[str, str]:
    """The sink id and the decision directory of a write."""
    if streaming:
        base = opts.decision_path or (f"{opts.checkpoint.rstrip('/')}/kafka2pc" if opts.checkpoint else None)
        if base is None:
            raise UsageError("set the query's checkpointLocation option (or kafka2pc.decisionPath): "
                             "the decisions live there")
        root = _directory(base)
        sink_id = "q" + hashlib.sha256(root.encode()).hexdigest()[:16]
    else:
        root = _directory(opts.decision_path or "~/.kafka2pc/spark")
        run_id = opts.run_id or f"unnamed-{os.getpid()}-{time.time_ns()}"
        sink_id = "r" + hashlib.sha256(run_id.encode()).hexdigest()[:16]
    return sink_id, os.path.join(root, sink_id)


@dataclass(frozen=True)
class _Options:
    """The data source's options, checked (the same in every process that builds a writer)."""

    config: Mapping[str, Any]
    topic: str | None
    run_id: str | None
    decision_path: str | None
    checkpoint: str | None
    prefix: str
    retain: int
    max_repairs: int

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> _Options:
        config: dict[str, Any] = {}
        for key, value in options.items():
            if key.lower().startswith("kafka.") and key.lower() != "kafka.":
                config[key[len("kafka."):]] = value
        if "bootstrap.servers" not in config:
            raise UsageError("option 'kafka.bootstrap.servers' must be specified for the kafka2pc data source")
        if "transactional.id" in config:
            raise UsageError("the kafka2pc data source chooses transactional ids: do not set "
                             "'kafka.transactional.id'")
        prefix = options.get("kafka2pc.transactionalIdPrefix", _DEFAULT_PREFIX)
        if not _NAME_RE.fullmatch(prefix):
            raise UsageError(f"invalid kafka2pc.transactionalIdPrefix {prefix!r}")
        return cls(
            config, options.get("topic"), options.get("kafka2pc.runId"), options.get("kafka2pc.decisionPath"),
            options.get("checkpointLocation"), prefix, _int_option(options, "kafka2pc.decisionsToRetain", 100),
            _int_option(options, "kafka2pc.maxRepairs", 3),
        )


def _int_option(options: Mapping[str, str], name: str, default: int) -> int:
    text = options.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"option {name} must be an integer, not {text!r}") from None
    if value < 0:
        raise UsageError(f"option {name} must not be negative, not {value}")
    return value


def _directory(path: str) -> str:
    """A local directory for decisions: a plain path or a ``file:`` URI (a mounted file system for clusters)."""
    if path.startswith("file:"):
        return local_path(path)
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", path):
        raise UsageError(
            f"decisions must live on a file system the driver mounts (a local path or file: URI), not {path!r}: "
            "set kafka2pc.decisionPath (or use the foreachBatch sink, which stores decisions through Hadoop)"
        )
    return os.path.abspath(os.path.expanduser(path))


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
    skip: bool = False
    """Batch: the run id's decision is complete, write nothing."""

    def coordinator(self, admin: TransactionAdmin, on_step: StepHook | None) -> SinkCoordinator:
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

    _on_step: ClassVar[StepHook | None] = None
    """Private test seam: a driver hook called at each :class:`~kafka2pc.recipes.spark.SinkStep` (subclass to set)."""
    _task_hook: ClassVar[TaskHook | None] = None
    """Private test seam: a task hook called at each :class:`~kafka2pc.recipes.spark.TaskStep` (subclass to set)."""

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
        opts = _Options.parse(self.options)
        columns = schema_columns(schema, opts.topic)
        sink_id, directory = _location(opts, streaming=streaming)
        admin = shared_admin(opts.config)  # the commit that follows in this worker reuses it
        if opts.topic is not None and opts.topic not in admin.topic_names():
            raise UnknownTopicError(f"topic {opts.topic!r} (the topic option) does not exist")
        limit = None
        if "transaction.timeout.ms" not in opts.config and "transaction.two.phase.commit.enable" not in opts.config:
            limit_s = admin.max_transaction_timeout_s()
            limit = default_transaction_timeout_ms(None if limit_s is None else round(limit_s * 1000))
        spec = WriterSpec(executor_config(opts.config, limit), f"{opts.prefix}{sink_id}", opts.topic, columns,
                          batch_id=0, task_hook=type(self)._task_hook)
        plan = _Plan(spec, sink_id, directory, 0, streaming, opts.max_repairs, opts.retain, dict(opts.config))
        latest = LocalDecisionStore(directory).latest()
        plan = dataclasses.replace(plan, slot=_free_slot(latest))
        if not streaming:
            plan = _settle_run(plan, admin, opts.run_id, type(self)._on_step)
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


def _settle_run(plan: _Plan, admin: TransactionAdmin, run_id: str | None, on_step: StepHook | None) -> _Plan:
    """Batch, before the tasks: complete the run's recorded decision, or abort what a died run left open."""
    coordinator = plan.coordinator(admin, on_step)
    existing = coordinator.store.get(0)
    if existing is None:
        aborted = coordinator.settle_leftovers()
        if aborted:
            logger.warning("run %s: aborted %d transactions a previous attempt of the run left open", run_id, aborted)
        return plan
    done = coordinator.complete(existing, None)
    if done.completion.aborted:
        logger.warning("run %s: Kafka aborted the decided transactions of partitions %s: the rerun writes them "
                       "again", run_id, done.completion.aborted)
        return plan
    logger.warning(
        "run %s was committed already (%d records in %d transactions, decision %s): this write writes nothing",
        run_id, sum(t.records for t in existing.transactions), len(existing.transactions), coordinator.store.location,
    )
    return dataclasses.replace(plan, skip=True)


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


def _commit(plan: _Plan, on_step: StepHook | None, messages: Sequence[WriterCommitMessage | None],
            batch_id: int) -> Completed | None:
    """The driver's commit: record the decision and complete it; a replayed batch completes its recorded one."""
    results = sorted((m.result for m in messages if isinstance(m, _Prepared) and m.result is not None),
                     key=lambda r: r.partition)
    if plan.skip:
        return None  # _settle_run said so
    admin = shared_admin(plan.admin_config)
    coordinator = plan.coordinator(admin, on_step)
    existing = coordinator.store.get(batch_id)
    if existing is None:
        done = coordinator.complete(coordinator.decide(batch_id, results, fingerprints=False), None)
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
    return done


def _abort(plan: _Plan, batch_id: int) -> None:
    """A failed write: abort every transaction no decision names (the tasks' prepared ones)."""
    plan.coordinator(shared_admin(plan.admin_config), None).abort_undecided(batch_id)


class Kafka2pcBatchWriter(_BatchWriterBase):
    """The batch writer of ``format("kafka2pc")``: Arrow batches in, one prepared transaction per task."""

    def __init__(self, plan: _Plan, on_step: StepHook | None) -> None:
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

    def __init__(self, plan: _Plan, on_step: StepHook | None) -> None:
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
