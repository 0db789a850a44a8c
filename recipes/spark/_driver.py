"""Driver side of the Spark sink: the two-phase-commit coordinator of each micro-batch.

See :mod:`kafka2pc.recipes.spark` for the protocol and ``docs/spark.md`` for
why it is exactly-once.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from kafka2pc._control import ControlPlane
from kafka2pc._exceptions import UsageError
from kafka2pc._producer import LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS
from kafka2pc._recovery import Decision, TransactionOutcome, outcome_of, settle
from kafka2pc.recipes.spark._executor import ArrowWriter, TaskHook, WriterSpec
from kafka2pc.recipes.spark._session import local_path, qualify, running_query_checkpoint
from kafka2pc.recipes.spark._store import DecisionStore, HadoopDecisionStore, LocalDecisionStore
from kafka2pc.recipes.spark._values import (
    RESULT_COLUMNS,
    RESULT_DDL,
    BatchMetrics,
    PartitionResult,
    SinkCompletionError,
    SinkDecision,
    SinkStep,
    SinkTransaction,
    StepHook,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

logger = logging.getLogger("kafka2pc.recipes.spark_sink")

DEFAULT_PREFIX: Final = "kafka2pc-spark-"
_NAME_RE: Final = re.compile(r"[A-Za-z0-9._-]{1,120}")


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
        faults: TaskHook | None = None,
        on_step: StepHook | None = None,
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
        self._task_hook = faults
        self._on_step = on_step
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
        self._step(SinkStep.AFTER_PREPARE, batch_id)
        t2 = time.monotonic()
        decision = SinkDecision(
            self._require_sink_id(), batch_id, 0,
            tuple(SinkTransaction(r.partition, r.transactional_id, r.state, r.records) for r in results),
            int(time.time() * 1000),
        )
        store.put(decision)
        decision_s = time.monotonic() - t2
        self._step(SinkStep.AFTER_DECISION, batch_id)
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
        spec = WriterSpec(
            producer_config=self._executor_config(), transactional_id_base=self.transactional_id_base,
            topic=self._topic, columns=columns, batch_id=batch_id, only_partitions=only_partitions,
            task_hook=self._task_hook if only_partitions is None else None,
        )
        writer: Any = ArrowWriter(spec)
        rows = df.select(*columns).coalesce(self._max_transactions).mapInArrow(writer, RESULT_DDL).collect()
        results = sorted(
            (PartitionResult(**{name: row[name] for name in RESULT_COLUMNS}) for row in rows),
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
                self._step(SinkStep.MID_COMPLETION, decision.batch_id)
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
                self._store = LocalDecisionStore(local_path(directory))
            else:
                self._store = HadoopDecisionStore(spark, directory)
        logger.info("sink %s: transactional ids %s-<partition>, decisions in %s", self._sink_id,
                    self.transactional_id_base, self._store.location)

    def _resolve_checkpoint(self, spark: SparkSession) -> str:
        running = running_query_checkpoint(spark)
        if self._checkpoint_location is None:
            if running is None:
                raise UsageError(
                    "cannot find the query's checkpoint location: pass checkpoint_location=... (the same "
                    "path as the query's checkpointLocation option)"
                )
            return running
        given = qualify(spark, self._checkpoint_location)
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

    def _step(self, step: SinkStep, batch_id: int) -> None:
        if self._on_step is not None:
            self._on_step(step, batch_id)
