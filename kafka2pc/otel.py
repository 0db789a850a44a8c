"""OpenTelemetry metrics and spans for kafka2pc (the ``[otel]`` extra).

``pip install 'kafka2pc[otel]'``, configure OpenTelemetry's SDK as usual, then
instrument what you run::

    from kafka2pc.otel import Telemetry

    telemetry = Telemetry()                     # the global meter and tracer providers
    producer = telemetry.instrument_producer(TwoPhaseCommitProducer(config))   # or an AsyncTwoPhaseCommitProducer
    writer = telemetry.instrument_dual_writer(DualWriter(engine, config))       # or WriterPool, AsyncDualWriter,
                                                                                # AsyncWriterPool
    df.writeStream.foreachBatch(telemetry.instrument_spark_sink(sink))

Every kind emits the same names: :data:`INSTRUMENTS` and :data:`SPANS` are the
one table of them (the Spark recipe's instrumentation reuses it).

Instruments (meter ``kafka2pc``; every point carries ``kafka2pc.component`` =
``producer``, ``dual_write`` or ``spark_sink``, and
``kafka2pc.transactional_id``, ``kafka2pc.pool`` (a writer pool's prefix) or
``kafka2pc.sink_id``):

* ``kafka2pc.transactions.committed`` (Counter): transactions committed, a recovery's commits too;
* ``kafka2pc.transactions.aborted`` (Counter): transactions aborted or rolled back;
* ``kafka2pc.transaction.prepare.duration`` (Histogram, s): prepare, flushing the records;
* ``kafka2pc.transaction.db_commit.duration`` (Histogram, s): the decision, the database COMMIT
  (Spark: the decision file);
* ``kafka2pc.transaction.commit.duration`` (Histogram, s): the Kafka commit (Spark: completing the batch);
* ``kafka2pc.transaction.open.age`` (Gauge, s): age of the open transaction (no point when none is);
* ``kafka2pc.transaction.prepared.age`` (Gauge, s): time since a prepared or in-doubt one was prepared;
* ``kafka2pc.transactions.in_doubt`` (Gauge): prepared transactions whose outcome is not settled;
* ``kafka2pc.heuristic_outcomes`` (Counter): the database committed, Kafka aborted.

Alert on ``kafka2pc.transaction.prepared.age`` approaching the transaction
timeout (librdkafka's transactions are aborted by the broker after
``transaction.timeout.ms``), on ``kafka2pc.transactions.in_doubt`` > 0 for
long, and on any ``kafka2pc.heuristic_outcomes``.

Spans (tracer ``kafka2pc``), children of the caller's current span:
``kafka2pc.prepare``, ``kafka2pc.db_commit`` (Spark: the durable decision),
``kafka2pc.kafka_commit``, ``kafka2pc.complete`` (a recovery's
``complete_transaction``) and ``kafka2pc.recovery`` (the dual write's
recovery).  An exception is recorded on the span and sets its status to ERROR.

How each part is observed, without changing it:

* the core producer: ``instrument_producer`` wraps the instance's
  transaction methods (the class is untouched);
* the core producer, asyncio: the sync producer it drives is instrumented; its
  calls run in the awaiting task's context (spans are children of its span);
* the dual write (a writer or a pool, sync or asyncio): a listener attached
  through the writer's public ``add_listener("step", ...)`` times the phases
  each step declares it begins or ends, and its ``metrics()`` snapshot
  (a pool's ``metrics().transactions``) feeds the counters and gauges (read at each
  collection, so nothing drifts: a rollback that passes no step is counted
  too).  A phase span an exception interrupted ends, with status ERROR, when
  the writer starts its next transaction or recovery;
* the Spark sink (``foreachBatch``, or ``format("kafka2pc")`` through the
  monitor ``register_data_source`` returns, whose batches are reported when
  they end): the function passed to ``foreachBatch`` wraps the sink and
  turns each batch's :class:`~kafka2pc.recipes.spark_sink.BatchMetrics` into
  points and spans (timed backwards from the batch's end; they describe the
  driver's phases: the tasks' writes and prepares, the decision file, the
  completion).  Only ``open.age`` is a live gauge for the sink (the batch in
  progress); a batch settles its transactions before it returns, so the
  sink's in-doubt count is zero between batches, and a repaired partition
  (Kafka aborted a decided transaction; the sink wrote it again) counts as a
  heuristic outcome with ``kafka2pc.repaired=true``.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

try:
    from opentelemetry import metrics, trace
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.trace import Span, Status, StatusCode
except ImportError as exc:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        "kafka2pc.otel needs OpenTelemetry: pip install 'kafka2pc[otel]' "
        "(opentelemetry-api and opentelemetry-sdk)"
    ) from exc

from kafka2pc import HeuristicOutcomeError, PreparedTxnState, TxnState, __version__
from kafka2pc._otel_tracks import (
    _OPEN_STATES,
    _PREPARED_STATES,
    _S,
    _W,
    COMPONENT,
    POOL,
    SINK_ID,
    TRANSACTIONAL_ID,
    _ProducerTrack,
    _SinkTrack,
    _SlotTrack,
    _WriterTrack,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from kafka2pc import TwoPhaseCommitProducer
    from kafka2pc.aio import AsyncTwoPhaseCommitProducer

    _P = TypeVar("_P", TwoPhaseCommitProducer, AsyncTwoPhaseCommitProducer)


__all__ = [
    "ATTRIBUTES",
    "INSTRUMENTS",
    "SCOPE",
    "SPANS",
    "Instrument",
    "Telemetry",
    "instrument_dual_writer",
    "instrument_producer",
    "instrument_spark_sink",
]

SCOPE = "kafka2pc"
"""The instrumentation scope (meter and tracer name)."""


@dataclass(frozen=True)
class Instrument:
    """One of kafka2pc's metric instruments: what every instrumented kind (and the Spark sinks) emits under it."""

    name: str
    kind: Literal["counter", "histogram", "gauge"]
    unit: str
    description: str


INSTRUMENTS: tuple[Instrument, ...] = (
    Instrument("kafka2pc.transactions.committed", "counter", "{transaction}", "Transactions committed"),
    Instrument("kafka2pc.transactions.aborted", "counter", "{transaction}", "Transactions aborted or rolled back"),
    Instrument("kafka2pc.heuristic_outcomes", "counter", "{transaction}",
               "Transactions the database (or decision) committed and Kafka aborted"),
    Instrument("kafka2pc.transaction.prepare.duration", "histogram", "s", "Time to prepare (flush) a transaction"),
    Instrument("kafka2pc.transaction.commit.duration", "histogram", "s", "Time to commit a transaction in Kafka"),
    Instrument("kafka2pc.transaction.db_commit.duration", "histogram", "s",
               "Time to make the decision durable (database COMMIT, Spark decision file)"),
    Instrument("kafka2pc.transaction.open.age", "gauge", "s", "Age of the open transaction"),
    Instrument("kafka2pc.transaction.prepared.age", "gauge", "s", "Time since the open transaction was prepared"),
    Instrument("kafka2pc.transactions.in_doubt", "gauge", "{transaction}",
               "Prepared transactions whose outcome is not settled yet"),
)
"""Every metric kafka2pc emits (meter :data:`SCOPE`), one vocabulary for the producers, the dual writers,
the writer pools and the Spark sinks; ``docs/observability.md`` lists the same names."""

SPANS: tuple[str, ...] = (
    "kafka2pc.prepare",
    "kafka2pc.db_commit",
    "kafka2pc.kafka_commit",
    "kafka2pc.abort",
    "kafka2pc.complete",
    "kafka2pc.recovery",
    "kafka2pc.spark.batch",
)
"""Every span name kafka2pc starts (tracer :data:`SCOPE`)."""

ATTRIBUTES: tuple[str, ...] = (COMPONENT, TRANSACTIONAL_ID, POOL, SINK_ID)
"""The attributes that say what a point or span is about: ``kafka2pc.component`` (``producer``,
``dual_write``, ``spark_sink``), then the transactional id, the writer pool's prefix or the sink's id."""

_BY_NAME = {i.name: i for i in INSTRUMENTS}

class Telemetry:
    """kafka2pc's OpenTelemetry instruments, and the ``instrument_*`` methods that feed them.

    ``meter_provider``/``tracer_provider`` default to OpenTelemetry's global
    providers.  Create one ``Telemetry`` per provider pair and instrument
    every producer, writer and sink through it (a second one on the same
    providers would register the same instruments twice).
    """

    def __init__(
        self,
        *,
        meter_provider: metrics.MeterProvider | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        meter = metrics.get_meter(SCOPE, __version__, meter_provider=meter_provider)
        self._tracer = trace.get_tracer(SCOPE, __version__, tracer_provider=tracer_provider)
        self._lock = threading.Lock()
        self._producers: list[_ProducerTrack] = []
        self._writers: list[_WriterTrack] = []
        self._sinks: list[_SinkTrack] = []
        self._committed = self._counter(meter, "kafka2pc.transactions.committed")
        self._aborted = self._counter(meter, "kafka2pc.transactions.aborted")
        self._heuristic = self._counter(meter, "kafka2pc.heuristic_outcomes")
        self._prepare_duration = self._histogram(meter, "kafka2pc.transaction.prepare.duration")
        self._commit_duration = self._histogram(meter, "kafka2pc.transaction.commit.duration")
        self._db_commit_duration = self._histogram(meter, "kafka2pc.transaction.db_commit.duration")
        self._phase_durations = {"prepare": self._prepare_duration, "db_commit": self._db_commit_duration,
                                 "kafka_commit": self._commit_duration}
        """The histogram of each dual-write phase (the phases a step declares it begins or ends)."""
        for name, callback in (
            ("kafka2pc.transaction.open.age", self._observe_open_age),
            ("kafka2pc.transaction.prepared.age", self._observe_prepared_age),
            ("kafka2pc.transactions.in_doubt", self._observe_in_doubt),
        ):
            spec = _BY_NAME[name]
            meter.create_observable_gauge(name, callbacks=[callback], unit=spec.unit, description=spec.description)

    @staticmethod
    def _counter(meter: metrics.Meter, name: str) -> metrics.Counter:
        spec = _BY_NAME[name]
        return meter.create_counter(name, unit=spec.unit, description=spec.description)

    @staticmethod
    def _histogram(meter: metrics.Meter, name: str) -> metrics.Histogram:
        spec = _BY_NAME[name]
        return meter.create_histogram(name, unit=spec.unit, description=spec.description)

    # -- the core producer ----------------------------------------------------------
    def instrument_producer(self, producer: _P) -> _P:
        """Record ``producer``'s transactions; returns the same producer (its methods wrapped).

        ``producer`` is a :class:`~kafka2pc.TwoPhaseCommitProducer` or a
        :class:`~kafka2pc.aio.AsyncTwoPhaseCommitProducer` (whose calls run the
        sync producer's methods in its thread, in the awaiting task's context:
        the spans are children of the task's current span).
        """
        sync: Any = getattr(producer, "sync_producer", producer)
        self._instrument_sync_producer(sync)
        return producer

    def _instrument_sync_producer(self, producer: TwoPhaseCommitProducer) -> None:
        track = _ProducerTrack(
            weakref.ref(producer), {COMPONENT: "producer", TRANSACTIONAL_ID: producer.transactional_id}
        )
        with self._lock:
            self._producers.append(track)
        attrs = track.attributes
        begin, prepare = producer.begin_transaction, producer.prepare_transaction
        commit, abort, complete = producer.commit_transaction, producer.abort_transaction, producer.complete_transaction

        def settled() -> None:
            track.open_since = track.prepared_since = None

        def begin_transaction() -> None:
            begin()
            track.open_since, track.prepared_since = time.monotonic(), None

        def prepare_transaction(timeout: float | None = None) -> PreparedTxnState:
            with self._span("kafka2pc.prepare", attrs) as span:
                started = time.monotonic()
                state = prepare(timeout)
                track.prepared_since = time.monotonic()
                self._prepare_duration.record(track.prepared_since - started, attrs)
                span.set_attribute("kafka2pc.prepared_state", str(state))
                return state

        def commit_transaction(timeout: float | None = None) -> None:
            recovering = producer.state is TxnState.RECOVERING
            with self._span("kafka2pc.complete" if recovering else "kafka2pc.kafka_commit", attrs):
                started = time.monotonic()
                self._heuristic_guard(lambda: commit(timeout), attrs)
                self._commit_duration.record(time.monotonic() - started, attrs)
                self._committed.add(1, attrs)
                settled()

        def abort_transaction(timeout: float | None = None) -> None:
            with self._span("kafka2pc.abort", attrs):
                abort(timeout)
                self._aborted.add(1, attrs)
                settled()

        def complete_transaction(state: PreparedTxnState, timeout: float | None = None) -> None:
            same_process = producer.state is TxnState.PREPARED
            commits = same_process and state == producer.prepared_state
            with self._span("kafka2pc.complete", attrs) as span:
                span.set_attribute("kafka2pc.prepared_state", str(state))
                started = time.monotonic()
                self._heuristic_guard(lambda: complete(state, timeout), attrs)
                if not same_process:
                    settlement = producer.last_settlement
                    decision = settlement.plan.decision.value if settlement is not None else "nothing"
                    commits = decision == "commit"
                    if decision == "abort":
                        self._aborted.add(1, attrs)
                    span.set_attribute("kafka2pc.decision", decision)
                elif not commits:
                    self._aborted.add(1, attrs)
                if commits:
                    self._commit_duration.record(time.monotonic() - started, attrs)
                    self._committed.add(1, attrs)
                settled()

        for name, wrapper in (
            ("begin_transaction", begin_transaction), ("prepare_transaction", prepare_transaction),
            ("commit_transaction", commit_transaction), ("abort_transaction", abort_transaction),
            ("complete_transaction", complete_transaction),
        ):
            setattr(producer, name, wrapper)

    # -- the dual write ----------------------------------------------------------------
    def instrument_dual_writer(self, writer: _W) -> _W:
        """Record ``writer``'s transactions through its steps and ``metrics()``; returns the same object.

        ``writer`` is a ``DualWriter``, a ``WriterPool`` or their asyncio
        twins (``AsyncDualWriter``, ``AsyncWriterPool``): the same metrics and
        spans.  A pool's points carry ``kafka2pc.pool`` (its prefix) instead
        of a transactional id, and its counters are the pool's
        (``pool.metrics().transactions``: retired slots included); each span
        names the slot's transactional id.  Observed through the writer's
        public listener API (``writer.add_listener("step", ...)``); the
        writer's own ``on_step`` hook, if any, still runs (after this one).
        """
        target: Any = writer
        if not callable(getattr(target, "add_listener", None)) or not callable(getattr(target, "metrics", None)):
            raise TypeError(
                f"instrument_dual_writer() takes a DualWriter, WriterPool, AsyncDualWriter or AsyncWriterPool, "
                f"not {type(writer).__name__}"
            )
        if hasattr(target, "prefix"):  # a pool
            track = _WriterTrack(weakref.ref(target), {COMPONENT: "dual_write", POOL: target.prefix},
                                 lambda pool: pool.metrics().transactions)
        else:
            attributes = {COMPONENT: "dual_write", TRANSACTIONAL_ID: target.transactional_id}
            track = _WriterTrack(weakref.ref(target), attributes, lambda one: one.metrics())
        with self._lock:
            self._writers.append(track)
        self._sync_writer(track)

        def observe(one: Any, step: Any) -> None:
            self._writer_step(track, one, step)

        target.add_listener("step", observe)
        return writer

    def _writer_step(self, track: _WriterTrack, writer: Any, step: Any) -> None:
        """One step of ``writer`` (a writer, or a pool's slot), read through what the step declares of itself:
        whether an attempt begins, which phase it begins or ends, whether it prepares or settles."""
        now = time.monotonic()
        slot = track.slot(writer)
        attrs = track.attributes
        if step.attempt_begins:
            rolled_back = writer.metrics().transactions_rolled_back
            self._end_stale_spans(slot, "rolled back" if rolled_back > slot.rolled_back_at_begin else "interrupted")
            slot.rolled_back_at_begin = rolled_back
            slot.prepared_since = None
            self._sync_writer(track)
        ended: str | None = step.phase_ends
        if ended is not None:
            started = self._end(slot, f"kafka2pc.{ended}", now)
            duration = self._phase_durations.get(ended)
            if started is not None and duration is not None:
                duration.record(now - started, attrs)
        if step.leaves_prepared:
            slot.prepared_since = now
        if step.settles:
            slot.prepared_since = None
            self._sync_writer(track)
        begun: str | None = step.phase_begins
        if begun is not None:
            self._start(slot, f"kafka2pc.{begun}", now)

    def _start(self, track: _SlotTrack, name: str, now: float) -> None:
        track.spans[name] = (self._tracer.start_span(name, attributes=track.attributes), now)

    def _end(self, track: _SlotTrack, name: str, now: float) -> float | None:
        entry = track.spans.pop(name, None)
        if entry is None:
            return None
        entry[0].end()
        return entry[1]

    @staticmethod
    def _end_stale_spans(track: _SlotTrack, why: str) -> None:
        for span, _ in track.spans.values():
            span.set_status(Status(StatusCode.ERROR, f"the transaction did not complete ({why})"))
            span.end()
        track.spans.clear()

    def _sync_writer(self, track: _WriterTrack) -> None:
        """Add what the writer's (or pool's) metrics counted since the last look to the counters."""
        snapshot = track.metrics()
        if snapshot is None:
            return
        with self._lock:
            for key, counter in (
                ("transactions_committed", self._committed),
                ("transactions_rolled_back", self._aborted),
                ("heuristic_outcomes", self._heuristic),
            ):
                value = getattr(snapshot, key)
                delta = value - track.seen.get(key, 0)
                track.seen[key] = value
                if delta > 0:
                    counter.add(delta, track.attributes)

    # -- the Spark sink ------------------------------------------------------------------
    def instrument_spark_sink(self, sink: _S) -> _S:
        """Record each batch ``sink`` writes (metrics and spans); returns the same sink, instrumented.

        As :meth:`instrument_producer` and :meth:`instrument_dual_writer`,
        the object is instrumented in place: pass it to ``foreachBatch`` as
        before (``query.foreachBatch(telemetry.instrument_spark_sink(sink))``).
        For ``format("kafka2pc")``, pass what ``register_data_source(spark)``
        returned: every batch of the data source in this driver process is
        recorded under the same names.
        """
        track = _SinkTrack(sink)
        with self._lock:
            self._sinks.append(track)
        target: Any = sink
        if callable(getattr(target, "add_batch_listener", None)):
            # format("kafka2pc")'s DataSourceMonitor: batches end in the JVM, each reported when it ended
            target.add_batch_listener(lambda batch: self._record_relayed_batch(track, batch))
            return sink
        if not callable(target) or not hasattr(target, "last_batch_metrics"):
            raise TypeError(f"instrument_spark_sink() takes a KafkaTwoPhaseSink or the monitor "
                            f"register_data_source() returns, not {type(sink).__name__}")
        write_batch = type(target).__call__

        def instrumented_call(this: Any, df: DataFrame, batch_id: int) -> None:
            with self._tracer.start_as_current_span("kafka2pc.spark.batch") as batch_span:
                batch_span.set_attribute("kafka2pc.batch_id", int(batch_id))
                track.open_since = time.monotonic()
                try:
                    write_batch(this, df, batch_id)
                finally:
                    track.open_since = None
                batch = this.last_batch_metrics
                if batch is not None and batch.batch_id == int(batch_id):
                    self._record_batch(track, batch)

        # ``sink(df, batch_id)`` looks ``__call__`` up on the class: give this one object a
        # subclass whose ``__call__`` records the batch (the sink's state and methods unchanged).
        target.__class__ = type(type(target).__name__, (type(target),), {
            "__call__": instrumented_call, "__module__": type(target).__module__,
            "__qualname__": type(target).__qualname__,
        })
        return sink

    def _record_relayed_batch(self, track: _SinkTrack, batch: Any) -> None:
        """A batch of ``format("kafka2pc")``, reported when it ended: its span is timed backwards."""
        end_ns = time.time_ns()
        batch_span = self._tracer.start_span(
            "kafka2pc.spark.batch", start_time=end_ns - int(batch.time_to_visibility_s * 1e9)
        )
        batch_span.set_attribute("kafka2pc.batch_id", int(batch.batch_id))
        with trace.use_span(batch_span, end_on_exit=False):
            self._record_batch(track, batch)
        batch_span.end(end_time=end_ns)

    def _record_batch(self, track: _SinkTrack, batch: Any) -> None:
        attrs = track.attributes
        end_ns = time.time_ns()
        phases = [("kafka2pc.kafka_commit", batch.completion_s)]
        if not batch.replayed:
            phases += [("kafka2pc.db_commit", batch.decision_s), ("kafka2pc.prepare", batch.write_s)]
        for name, seconds in phases:  # backwards from the end of the batch
            start_ns = end_ns - int(seconds * 1e9)
            span = self._tracer.start_span(name, attributes=attrs, start_time=start_ns)
            span.set_attribute("kafka2pc.batch_id", batch.batch_id)
            span.end(end_time=end_ns)
            end_ns = start_ns
        if not batch.replayed:
            self._prepare_duration.record(batch.task_prepare_s, attrs)
            self._db_commit_duration.record(batch.decision_s, attrs)
        self._commit_duration.record(batch.completion_s, attrs)
        # A replay reports the batch's transactions as committed again (they are): count them
        # only if this process has not (the driver that wrote them may have died before its count).
        if batch.batch_id not in track.counted:
            track.counted.append(batch.batch_id)
            self._committed.add(batch.transactions_committed, attrs)
        aborted = batch.stray_transactions_aborted + batch.leftovers_aborted
        if aborted:
            self._aborted.add(aborted, attrs)
        if batch.repaired_partitions:
            self._heuristic.add(len(batch.repaired_partitions), {**attrs, "kafka2pc.repaired": True})

    # -- gauges ------------------------------------------------------------------------
    def _live(self) -> tuple[list[tuple[_ProducerTrack, TwoPhaseCommitProducer]], list[tuple[_WriterTrack, Any]]]:
        with self._lock:
            producers = [(t, p) for t in self._producers if (p := t.producer()) is not None]
            writers = [(t, w) for t in self._writers if (w := t.writer()) is not None]
            self._producers = [t for t, _ in producers]
            self._writers = [t for t, _ in writers]
        return producers, writers

    def _observe_open_age(self, options: CallbackOptions) -> Iterable[Observation]:
        now = time.monotonic()
        producers, writers = self._live()
        for ptrack, producer in producers:
            if ptrack.open_since is not None and producer.state in _OPEN_STATES:
                yield Observation(now - ptrack.open_since, ptrack.attributes)
        for wtrack, writer in writers:
            self._sync_writer(wtrack)
            age = wtrack.snapshot(writer).oldest_open_transaction_age_s
            if age is not None:
                yield Observation(age, wtrack.attributes)
        for strack in list(self._sinks):
            since = strack.open_since
            if since is not None:
                yield Observation(now - since, strack.attributes)

    def _observe_prepared_age(self, options: CallbackOptions) -> Iterable[Observation]:
        now = time.monotonic()
        producers, writers = self._live()
        for ptrack, producer in producers:
            if ptrack.prepared_since is not None and producer.state in _PREPARED_STATES:
                yield Observation(now - ptrack.prepared_since, ptrack.attributes)
        for wtrack, writer in writers:
            snapshot = wtrack.snapshot(writer)
            open_ = snapshot.oldest_open_transaction_age_s is not None or snapshot.in_doubt_transactions > 0
            since = wtrack.prepared_since
            if since is not None and open_:
                yield Observation(now - since, wtrack.attributes)

    def _observe_in_doubt(self, options: CallbackOptions) -> Iterable[Observation]:
        producers, writers = self._live()
        for ptrack, producer in producers:
            yield Observation(1 if producer.state is TxnState.IN_DOUBT else 0, ptrack.attributes)
        for wtrack, writer in writers:
            yield Observation(wtrack.snapshot(writer).in_doubt_transactions, wtrack.attributes)
        for strack in list(self._sinks):
            yield Observation(0, strack.attributes)

    # -- helpers -------------------------------------------------------------------------
    @contextmanager
    def _span(self, name: str, attributes: dict[str, str]) -> Iterator[Span]:
        with self._tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span

    def _heuristic_guard(self, call: Callable[[], None], attrs: dict[str, str]) -> None:
        try:
            call()
        except HeuristicOutcomeError:
            self._heuristic.add(1, attrs)
            raise


_default: Telemetry | None = None
_default_lock = threading.Lock()


def _global() -> Telemetry:
    global _default
    with _default_lock:
        if _default is None:
            _default = Telemetry()
        return _default


def instrument_producer(producer: _P) -> _P:
    """:meth:`Telemetry.instrument_producer` with OpenTelemetry's global providers."""
    return _global().instrument_producer(producer)


def instrument_dual_writer(writer: _W) -> _W:
    """:meth:`Telemetry.instrument_dual_writer` with OpenTelemetry's global providers."""
    return _global().instrument_dual_writer(writer)


def instrument_spark_sink(sink: _S) -> _S:
    """:meth:`Telemetry.instrument_spark_sink` with OpenTelemetry's global providers."""
    return _global().instrument_spark_sink(sink)
