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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from kafka2pc import TransactionAdmin, UsageError

from ._completion import job_error
from ._config import batch_columns, default_transaction_timeout_ms, executor_config
from ._executor import ArrowWriter, TaskHook, WriterSpec
from ._options import DEFAULT_PREFIX, check_reachable
from ._protocol import Rewrite, SinkCoordinator
from ._relay import receiver_address, relayed
from ._session import is_connect, local_path, qualify, running_query_checkpoint, running_query_id
from ._store import DecisionStore, HadoopDecisionStore, LocalDecisionStore
from ._values import (
    RESULT_COLUMNS,
    RESULT_DDL,
    BatchMetrics,
    PartitionResult,
    SinkCompletionError,
    SinkDecision,
    SinkRecovery,
    SinkStepHook,
    SinkTransaction,
    UnknownTopicError,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

logger = logging.getLogger("kafka2pc.recipes.spark_sink")

_NAME_RE: Final = re.compile(r"[A-Za-z0-9._-]{1,120}")


@dataclass
class _Binding:
    """The sink's state for one query (one checkpoint): its ids, its decisions, its lock."""

    checkpoint: str | None
    coordinator: SinkCoordinator
    lock: threading.Lock = field(default_factory=threading.Lock)
    recovered: bool = False

    @property
    def sink_id(self) -> str:
        return self.coordinator.sink_id

    @property
    def transactional_id_base(self) -> str:
        return self.coordinator.transactional_id_base

    @property
    def store(self) -> DecisionStore:
        return self.coordinator.store


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

    One sink object may serve several queries, one after the other or at the
    same time: each query (each checkpoint) gets its own sink id, decisions
    and lock.  Only a sink built with an explicit ``checkpoint_location``,
    ``sink_id`` or ``decision_store`` is tied to one query; another query
    calling it gets a :class:`~kafka2pc.UsageError`.

    ``on_step`` (a :data:`SinkStepHook`) is a testing and tracing aid called on
    the driver at each :class:`SinkStep`.

    The first batch (or :meth:`recover`) checks that a bootstrap address
    accepts connections: a refused or unresolvable bootstrap fails at once
    with :class:`~kafka2pc.BrokerUnavailableError` naming each address.

    ``sink.metrics()`` returns the last ``metrics_history`` :class:`BatchMetrics`;
    ``sink.last_batch_metrics`` the newest.  Call :meth:`recover` to settle
    leftovers without running a batch, :meth:`close` when the query is done.

    On Spark Connect, ``foreachBatch(sink)`` pickles the sink and runs the
    copy in the server's ``foreachBatch`` worker, which cannot see the running
    query: pass ``checkpoint_location`` (a path the server mounts).  The copy
    builds its own locks and clients there; its log records and metrics reach
    this object when the server runs on this host (see ``docs/spark.md``,
    "Spark Connect").

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
        on_step: SinkStepHook | None = None,
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
        self._task_hook: TaskHook | None = None  # kafka2pc's tests set it (inject_task_hook)
        self._on_step = on_step
        self._metrics: deque[BatchMetrics] = deque(maxlen=max(1, metrics_history))
        self._admin: TransactionAdmin | None = None
        self._txn_timeout_ms: int | None = None
        self._topic_checked = False
        self._bindings: dict[str, _Binding] = {}
        self._by_query: dict[str, _Binding] = {}
        self._current: _Binding | None = None
        self._lock = threading.Lock()  # guards the bindings and the lazily built shared state
        self._relay_address: str | None = None  # a pickled copy's (Spark Connect): the client's relay
        self._relay_token: str | None = None

    # -- pickling (Spark Connect's foreachBatch) -------------------------------
    _RUNTIME_FIELDS: Final = ("_lock", "_admin", "_bindings", "_by_query", "_current", "_txn_timeout_ms",
                              "_topic_checked", "_metrics")

    def __getstate__(self) -> dict[str, Any]:
        """The sink's settings, without what it built where it ran (locks, clients, queries, metrics).

        Spark Connect pickles a ``foreachBatch`` function to run it in the
        server; the copy builds its clients and bindings again there, lazily,
        and relays its metrics and log records to this process (when the
        server runs on this host).
        """
        state = {k: v for k, v in self.__dict__.items() if k not in self._RUNTIME_FIELDS}
        state["_metrics_history"] = self._metrics.maxlen
        if self._relay_address is None:  # this process is the client: the copy relays to it
            state["_relay_address"], self._relay_token = receiver_address(self._receive, self._relay_token)
            state["_relay_token"] = self._relay_token
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        history = state.pop("_metrics_history")
        self.__dict__.update(state)
        self._metrics = deque(maxlen=history)
        self._admin = None
        self._txn_timeout_ms = None
        self._topic_checked = False
        self._bindings = {}
        self._by_query = {}
        self._current = None
        self._lock = threading.Lock()

    def _receive(self, metrics: BatchMetrics) -> None:
        """A pickled copy's batch metrics, relayed back (Spark Connect)."""
        self._metrics.append(metrics)

    # -- public -----------------------------------------------------------------
    @property
    def sink_id(self) -> str | None:
        """The sink id of the query served last (known after its first batch when derived from the checkpoint)."""
        return self._current.sink_id if self._current is not None else self._sink_id

    @property
    def transactional_id_base(self) -> str:
        """``<prefix><sink id>``; partition ``p`` writes under ``<base>-<p>`` (the query served last)."""
        sink_id = self.sink_id
        if sink_id is None:
            raise UsageError("the sink id is not known before the first batch (pass sink_id=...)")
        return f"{self._prefix}{sink_id}"

    @property
    def decision_store(self) -> DecisionStore | None:
        """Where the decisions of the query served last are stored (known after its first batch unless given)."""
        return self._current.store if self._current is not None else self._store

    def metrics(self) -> list[BatchMetrics]:
        """Metrics of the recent batches (of every query served), oldest first: a copy, as ``writer.metrics()``."""
        return list(self._metrics)

    @property
    def last_batch_metrics(self) -> BatchMetrics | None:
        """Metrics of the newest batch."""
        return self._metrics[-1] if self._metrics else None

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        """Write micro-batch ``batch_id`` exactly once (the ``foreachBatch`` entry point)."""
        with relayed(self._relay_address) as relay:
            binding = self._binding_for(df.sparkSession)
            with binding.lock:
                self._current = binding
                metrics = self._run_batch(binding, df, int(batch_id))
            if relay is not None:
                relay.send_batch(metrics, self._relay_token)

    def recover(self, spark: SparkSession | None = None, *, checkpoint_location: str | None = None) -> SinkRecovery:
        """Settle every open transaction of this sink with the last durable decision; say what it did.

        Runs automatically before the first batch of every query in every
        driver process; call it after a query failed or was stopped to end
        what it left open at once.  With ``spark``, the query calling it (from
        inside its ``foreachBatch``), else the query whose checkpoint is
        ``checkpoint_location`` (default: the sink's own), else the one query
        this sink served.  Without ``spark``, every query this sink served.
        The :class:`SinkRecovery` counts the transactions committed (the last
        decision names them) and aborted, as the data source's
        :func:`~kafka2pc.recipes.spark.recover` does.  From a new driver process::

            KafkaTwoPhaseSink(config, topic="out").recover(spark, checkpoint_location="/chk/q1")
        """
        if spark is not None:
            bindings = [self._binding_for(spark, checkpoint_location)]
        else:
            if checkpoint_location is not None:
                raise UsageError("recover(checkpoint_location=...) needs the SparkSession: recover(spark, ...)")
            with self._lock:
                bindings = list(self._bindings.values())
            if not bindings:
                raise UsageError("recover() needs the SparkSession before the first batch")
        settled = SinkRecovery()
        for binding in bindings:
            with binding.lock:
                settled += binding.coordinator.settle_leftovers()
                binding.recovered = True
        return settled

    def close(self, timeout: float | None = None) -> None:
        """Close the driver's coordinator connections.

        Closing sockets does not wait on the network: it returns at once, well within any ``timeout``
        (seconds; accepted for the signature every ``close`` of kafka2pc shares). A negative ``timeout`` is a
        :class:`~kafka2pc.UsageError`.
        """
        if timeout is not None and timeout < 0:
            raise UsageError(f"close(timeout={timeout}): a timeout is in seconds and not negative")
        if self._admin is not None:
            self._admin.close(timeout)
            self._admin = None

    # -- one batch -------------------------------------------------------------------
    def _run_batch(self, b: _Binding, df: DataFrame, batch_id: int) -> BatchMetrics:
        started = time.monotonic()
        c = b.coordinator
        existing = b.store.get(batch_id)
        if existing is not None:
            logger.info("batch %d: replayed; decision revision %d exists: completing it, not writing again",
                        batch_id, existing.revision)
            t0 = time.monotonic()
            done = c.complete(existing, self._rewriter(b, df))
            b.recovered = True
            now = time.monotonic()
            return self._record(BatchMetrics(
                batch_id, True, sum(t.records for t in done.decision.transactions), len(done.decision.transactions),
                0, done.completion.committed, done.completion.strays_aborted, 0, tuple(done.repaired), {}, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, now - t0, now - started, now - t0, sink_id=b.sink_id,
            ))
        t0 = time.monotonic()
        leftovers = 0
        if not b.recovered:
            leftovers = c.settle_leftovers().aborted
            b.recovered = True
        self._check_topic_option()
        settle_s = time.monotonic() - t0
        t1 = time.monotonic()
        results = self._write(b, df, batch_id)
        write_s = time.monotonic() - t1
        t2 = time.monotonic()
        decision = c.decide(batch_id, results)
        decision_s = time.monotonic() - t2
        t3 = time.monotonic()
        done = c.complete(decision, self._rewriter(b, df))
        now = time.monotonic()
        visible = done.completion.visible_at or now  # the last commit; the stray sweep after it hides nothing
        c.purge(batch_id)
        return self._record(BatchMetrics(
            batch_id, False, sum(t.records for t in done.decision.transactions), len(done.decision.transactions),
            len(results), done.completion.committed, done.completion.strays_aborted, leftovers,
            tuple(done.repaired), {r.partition: r.attempt for r in results}, settle_s, write_s,
            max((r.open_s for r in results), default=0.0), max((r.write_s for r in results), default=0.0),
            max((r.prepare_s for r in results), default=0.0), decision_s, now - t3,
            visible - started, visible - t2, sink_id=b.sink_id,
        ))

    def _rewriter(self, b: _Binding, df: DataFrame) -> Rewrite:
        """The repair's rewrite: run the write job again for the lost partitions (all of them when ``whole``)."""

        def rewrite(decision: SinkDecision, lost: frozenset[int], whole: bool) -> list[PartitionResult]:
            return self._write(b, df, decision.batch_id, repair=True, only_partitions=None if whole else lost,
                               named=decision.by_transactional_id())

        return rewrite

    def _write(
        self, b: _Binding, df: DataFrame, batch_id: int, *, repair: bool = False,
        only_partitions: frozenset[int] | None = None, named: Mapping[str, SinkTransaction] | None = None,
    ) -> list[PartitionResult]:
        """Run the Spark job that writes and prepares; return one result per non-empty partition.

        If the job fails, every transaction it prepared is aborted before the
        error propagates: nothing was decided for them (``named``, the
        transactions a decision names, are kept), so that is always safe, and
        it keeps a failed batch from holding back ``read_committed`` readers
        until the transaction timeout.
        """
        columns = self._columns(df)
        # Each row's hash, computed in the JVM (cheap); the tasks sum them into the
        # partition's fingerprint, which a repair compares (see repair_mismatch).  SQL
        # text, not pyspark.sql.functions: the same on a classic and a Connect session.
        hashed = [f"`{c}`" for c in columns] + [f"isnull(`{c}`)" for c in columns if c in ("key", "value")]
        spec = WriterSpec(
            producer_config=self._executor_config(), transactional_id_base=b.transactional_id_base,
            topic=self._topic, columns=columns, batch_id=batch_id, only_partitions=only_partitions,
            task_hook=None if repair else self._task_hook, fingerprint_column=_FINGERPRINT_COLUMN,
        )
        writer: Any = ArrowWriter(spec)
        job = (
            df.selectExpr(*(f"`{c}`" for c in columns), f"xxhash64({', '.join(hashed)}) AS {_FINGERPRINT_COLUMN}")
            .coalesce(self._max_transactions).mapInArrow(writer, RESULT_DDL)
        )
        try:
            rows = job.collect()
        except Exception as exc:
            aborted = b.coordinator.abort_undecided(batch_id, named)
            raise job_error(batch_id, exc, aborted) from exc
        results = sorted(
            (PartitionResult(**{name: row[name] for name in RESULT_COLUMNS}) for row in rows),
            key=lambda r: r.partition,
        )
        seen = [r.partition for r in results]
        if len(seen) != len(set(seen)):  # Spark returns one result per partition; never trust blindly
            raise SinkCompletionError(f"batch {batch_id}: more than one result for a partition: {seen}")
        return results

    def _check_topic_option(self) -> None:
        """Fail fast, naming it, if the ``topic`` option names a topic the cluster does not have."""
        if self._topic is None or self._topic_checked:
            return
        if self._topic not in self._transaction_admin().topic_names():
            raise UnknownTopicError(f"topic {self._topic!r} (the sink's topic option) does not exist")
        self._topic_checked = True

    # -- helpers ---------------------------------------------------------------
    def _binding_for(self, spark: SparkSession, checkpoint_location: str | None = None) -> _Binding:
        """The sink's state for the query calling us; created on its first batch (or refused).

        Outside a query (``recover`` after the query stopped): the query at
        ``checkpoint_location`` or the sink's own, else the only one served.
        """
        query_id = running_query_id(spark)
        with self._lock:
            if query_id is not None and query_id in self._by_query and checkpoint_location is None:
                return self._by_query[query_id]
            if query_id is None and checkpoint_location is None and self._checkpoint_location is None:
                if len(self._bindings) == 1:
                    (only,) = self._bindings.values()
                    return only
                if self._bindings:
                    raise UsageError(
                        "this sink served several queries: pass checkpoint_location=... to say which to recover"
                    )
            checkpoint = self._resolve_checkpoint(spark, checkpoint_location)
            key = checkpoint.rstrip("/") if checkpoint is not None else ""
            binding = self._bindings.get(key)
            if binding is None:
                binding = self._new_binding(spark, checkpoint)
                self._bindings[key] = binding
            if query_id is not None and checkpoint_location is None:
                self._by_query[query_id] = binding
            return binding

    def _new_binding(self, spark: SparkSession, checkpoint: str | None) -> _Binding:
        if self._bindings and (self._sink_id is not None or self._store is not None):
            (other,) = self._bindings.values()
            given = "sink_id" if self._sink_id is not None else "decision_store"
            raise UsageError(
                f"this sink was created with {given}=... and serves the query with checkpoint {other.checkpoint}; "
                f"another query (checkpoint {checkpoint}) would share its transactional ids or decisions and "
                "lose rows: create one KafkaTwoPhaseSink per query, or let the sink derive the sink id and the "
                "decision store from each query's checkpoint"
            )
        if checkpoint is None and (self._sink_id is None or self._store is None):
            why = ("on Spark Connect the foreachBatch worker is not told its query" if is_connect(spark) else
                   "cannot find the query's checkpoint location")
            raise UsageError(
                f"{why}: pass checkpoint_location=... (the same path as the query's checkpointLocation option)"
            )
        sink_id = self._sink_id
        if sink_id is None:
            assert checkpoint is not None
            sink_id = "q" + hashlib.sha256(checkpoint.encode()).hexdigest()[:16]
        store = self._store
        if store is None:
            assert checkpoint is not None
            directory = f"{checkpoint.rstrip('/')}/kafka2pc/{sink_id}"
            store = (LocalDecisionStore(local_path(directory)) if directory.startswith("file:")
                     else HadoopDecisionStore(spark, directory))
        coordinator = SinkCoordinator(self._transaction_admin, sink_id, f"{self._prefix}{sink_id}", store,
                                      max_repairs=self._max_repairs, decisions_to_retain=self._retain,
                                      on_step=self._on_step)
        binding = _Binding(checkpoint, coordinator)
        logger.info("sink %s: transactional ids %s-<partition>, decisions in %s", sink_id,
                    binding.transactional_id_base, store.location)
        return binding

    def _resolve_checkpoint(self, spark: SparkSession, location: str | None = None) -> str | None:
        running = running_query_checkpoint(spark) if location is None else None
        location = location if location is not None else self._checkpoint_location
        if location is None:
            return running
        given = qualify(spark, location)
        if running is not None and running.rstrip("/") != given.rstrip("/"):
            raise UsageError(
                f"checkpoint_location={location!r} ({given}) is not the running query's "
                f"checkpoint location {running}: decisions must live with the query's checkpoint (a sink "
                "built with checkpoint_location=... serves that one query only)"
            )
        if self._checkpoint_location is not None and location != self._checkpoint_location:
            own = qualify(spark, self._checkpoint_location)
            if own.rstrip("/") != given.rstrip("/"):
                raise UsageError(f"this sink serves the query with checkpoint {own}, not {given}")
        return given

    def _columns(self, df: DataFrame) -> tuple[str, ...]:
        return batch_columns(df, self._topic)

    def _executor_config(self) -> dict[str, Any]:
        if (self._txn_timeout_ms is None and "transaction.timeout.ms" not in self._config
                and "transaction.two.phase.commit.enable" not in self._config):
            # A benign race between concurrent queries: both ask, same answer.
            limit_s = self._transaction_admin().max_transaction_timeout_s()
            self._txn_timeout_ms = default_transaction_timeout_ms(None if limit_s is None else round(limit_s * 1000))
        return executor_config(self._config, self._txn_timeout_ms)

    def _transaction_admin(self) -> TransactionAdmin:
        with self._lock:
            if self._admin is None:
                check_reachable(self._config)  # a refused bootstrap fails now, naming it, not after 30 s
                self._admin = TransactionAdmin(self._config)
            return self._admin

    def _record(self, metrics: BatchMetrics) -> BatchMetrics:
        self._metrics.append(metrics)
        logger.info(
            "batch %d%s: %d records in %d transactions (%d committed, %d strays aborted, repaired %s); "
            "write %.3fs, decision %.3fs, completion %.3fs, visible after %.3fs",
            metrics.batch_id, " (replay)" if metrics.replayed else "", metrics.records, metrics.partitions,
            metrics.transactions_committed, metrics.stray_transactions_aborted,
            list(metrics.repaired_partitions) or "none", metrics.write_s, metrics.decision_s,
            metrics.completion_s, metrics.time_to_visibility_s,
        )
        return metrics


_FINGERPRINT_COLUMN: Final = "__kafka2pc_row_hash"


def inject_task_hook(sink: KafkaTwoPhaseSink, hook: TaskHook | None) -> KafkaTwoPhaseSink:
    """Give ``sink``'s tasks a task hook (a testing aid: the seam that replaces ``faults=``); return the sink.

    Tests import it from ``_faults``, beside the hooks they inject.
    """
    sink._task_hook = hook
    return sink
