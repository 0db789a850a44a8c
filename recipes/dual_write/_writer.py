"""The writer: :class:`DualWriter` (normal path and recovery) and :func:`recover_all`."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy as sa

from kafka2pc import (
    DEFAULT_CLOSE_TIMEOUT_S,
    OnHeuristic,
    PreparedTxnState,
    UsageError,
)
from kafka2pc._deprecation import deprecated_property, seconds_from_ms

from ._bind import Bind
from ._core import WriterCore
from ._events import EVENTS, Listeners, StepListener
from ._handle import DualWriteTransaction
from ._lifecycle import WriterState
from ._options import DEFAULT_QUEUE_FULL_TIMEOUT_S, DEFAULT_SETTLE_ATTEMPTS, WriterOptions, options_from
from ._recovery import Recovery
from ._runner import TransactionRunner
from ._runtime import THREADS
from ._schema import create_state_table
from ._schema import define_outbox_table as _make_outbox_table
from ._schema import define_state_table as _make_state_table
from ._settle import Settler
from ._values import (
    DualWriteMetrics,
    RecoveryResult,
    StepHook,
    heuristic_flags,
)

if TYPE_CHECKING:
    from typing_extensions import Self

    from kafka2pc import TwoPhaseCommitProducer

    from ._runtime import Runtime

__all__ = ["DualWriter", "recover_all", "writer_on"]

logger = logging.getLogger(__name__)

class DualWriter:
    """Atomic writes to a SQL database and Kafka under one transactional id (KIP-939's dual-write recipe).

    ``engine`` is the database holding the state table (and the outbox table
    with ``retain_records=True``); the Sessions and Connections given to
    :meth:`transaction` must use that same database.  ``producer_config`` is a
    confluent-kafka producer configuration with ``transactional.id``: run one
    writer per instance (or per shard), each with its own id.

    ``retain_records=True`` also keeps each transaction's records in the
    outbox table until Kafka has committed them, so that a transaction Kafka
    aborted behind the database's back (heuristic outcome) is re-published by
    :meth:`recover` instead of lost.  ``lock_timeout_s`` bounds the wait for
    the state row lock, in seconds, on PostgreSQL and MariaDB/MySQL (SQLite's
    wait is the driver's busy timeout); ``lock_timeout_ms`` is its deprecated
    0.1 spelling.  ``kafka_timeout_s`` bounds the prepare (flush), commit and
    abort calls (default: librdkafka's own limits, up to
    ``transaction.timeout.ms``); a prepare that times out rolls the
    transaction back, a commit that times out is settled through recovery.
    ``on_step`` is a testing and tracing aid, called at every
    :class:`Step`; an exception it raises before the database commit rolls
    the transaction back.

    Thread-safe: transactions of one writer run one at a time.
    """

    def __init__(
        self,
        engine: sa.Engine,
        producer_config: Mapping[str, Any],
        *,
        state_table: sa.Table | None = None,
        outbox_table: sa.Table | None = None,
        retain_records: bool = False,
        lock_timeout_s: float | None = None,
        on_step: StepHook | None = None,
        settle_attempts: int = DEFAULT_SETTLE_ATTEMPTS,
        queue_full_timeout_s: float = DEFAULT_QUEUE_FULL_TIMEOUT_S,
        kafka_timeout_s: float | None = None,
        lock_timeout_ms: int | None = None,
        options: WriterOptions | None = None,
    ) -> None:
        """As the class documents; ``options`` is the same settings as one value (instead of the keywords)."""
        lock_timeout_s = seconds_from_ms(type(self).__name__, "lock_timeout_ms", lock_timeout_ms,
                                         "lock_timeout_s", lock_timeout_s)
        options = options_from(options, retain_records=retain_records, lock_timeout_s=lock_timeout_s,
                               on_step=on_step, settle_attempts=settle_attempts,
                               queue_full_timeout_s=queue_full_timeout_s, kafka_timeout_s=kafka_timeout_s)
        self._setup(engine, producer_config, options, THREADS, state_table, outbox_table, Listeners(options.on_step))

    def _setup(
        self, engine: sa.Engine, producer_config: Mapping[str, Any], options: WriterOptions, runtime: Runtime,
        state_table: sa.Table | None, outbox_table: sa.Table | None, listeners: Listeners,
    ) -> None:
        tid = producer_config.get("transactional.id")
        if not isinstance(tid, str) or not tid:
            raise UsageError("producer_config must set 'transactional.id' to a non-empty string")
        if len(tid) > 255:
            raise UsageError("transactional.id must fit the state table's VARCHAR(255)")
        metadata = sa.MetaData()
        table = state_table if state_table is not None else _make_state_table(metadata)
        if options.retain_records and outbox_table is None:
            outbox_table = _make_outbox_table(metadata)
        listeners.bind(self)
        self._options = options
        self._listeners = listeners
        self._core = WriterCore(engine, dict(producer_config), tid, options, runtime, table, outbox_table, listeners)
        self._recovery = Recovery(self._core)
        self._runner = TransactionRunner(self._core, self._recovery, Settler(self._core, self._recovery))

    # -- introspection -------------------------------------------------------------
    @property
    def transactional_id(self) -> str:
        """The Kafka transactional id (and the state row's key)."""
        return self._core.tid

    @property
    def state_table(self) -> sa.Table:
        """The state table this writer locks and updates."""
        return self._core.table

    @property
    def outbox_table(self) -> sa.Table | None:
        """The outbox table (``None`` unless configured or ``retain_records=True``)."""
        return self._core.outbox

    @property
    def retain_records(self) -> bool:
        """Whether records are kept in the outbox until Kafka commits them."""
        return self._core.retain

    @property
    def producer(self) -> TwoPhaseCommitProducer | None:
        """The current producer (``None`` before the first recovery)."""
        return self._core.producer

    @property
    def fenced(self) -> bool:
        """True once another instance took over this transactional id; only :meth:`recover` resets it."""
        return self._core.status is WriterState.FENCED

    @property
    def state(self) -> WriterState:
        """Where the writer is in its life cycle (as :attr:`kafka2pc.TwoPhaseCommitProducer.state` for the producer)."""
        return self._core.status

    status = deprecated_property("status", "state", lambda self: self._core.status)

    @property
    def engine(self) -> sa.Engine:
        """The database holding the state table."""
        return self._core.engine

    def create_tables(self) -> None:
        """Create the state (and outbox) table if missing: a convenience for scripts and tests."""
        create_state_table(self._core.engine, self._core.table)
        if self._core.outbox is not None:
            self._core.outbox.create(self._core.engine, checkfirst=True)

    def metrics(self) -> DualWriteMetrics:
        """A snapshot of this writer's gauges and counters (no I/O; safe from any thread)."""
        now = time.monotonic()
        runner = self._runner
        starts = [t for t in (runner.open_since, self._core.in_doubt_since) if t is not None]
        return DualWriteMetrics(
            writers=1,
            oldest_open_transaction_age_s=(now - min(starts)) if starts else None,
            in_doubt_transactions=1 if self._core.in_doubt is not None else 0,
            transactions_committed=runner.committed,
            transactions_rolled_back=runner.rolled_back,
            recoveries=self._recovery.recoveries,
            heuristic_outcomes=self._core.heuristics,
            records_republished=self._recovery.republished,
        )

    @property
    def options(self) -> WriterOptions:
        """How this writer runs (its constructor's options as one value)."""
        return self._options

    # -- events ----------------------------------------------------------------------
    events: ClassVar[frozenset[str]] = EVENTS
    """The events listeners may attach to (see :meth:`add_listener`)."""

    def add_listener(self, event: str, fn: StepListener) -> None:
        """Call ``fn(writer, step)`` at every :class:`Step` this writer reaches (``event="step"``).

        SQLAlchemy's event model: the writer declares its events
        (:attr:`events`) and listeners attach through this call.  Listeners run
        in the thread running the step, before ``on_step``; an exception one
        raises before the database commit rolls the transaction back.

        Example::

            writer.add_listener("step", lambda writer, step: print(writer.transactional_id, step.value))
        """
        self._listeners.add(event, fn)

    def remove_listener(self, event: str, fn: StepListener) -> None:
        """Detach a listener :meth:`add_listener` attached (:class:`~kafka2pc.UsageError` if it was not)."""
        self._listeners.remove(event, fn)

    # -- life cycle ------------------------------------------------------------------
    def recover(
        self,
        *,
        on_heuristic: OnHeuristic = "raise",
        raise_on_heuristic: bool | None = None,
        acknowledge_heuristic: bool | None = None,
    ) -> RecoveryResult:
        """Settle whatever the previous owner of this transactional id left, then accept new work.

        First claims the state row: locks it, reads the stored
        :class:`PreparedTxnState` (the empty state if there is no row), gives
        the row a new version and commits that, so that no older instance can
        commit its database side any more, whatever happens next.  Then, with
        a new producer, ``init_transactions(keep_prepared_txn=True)`` and
        ``complete_transaction(stored)``: the open Kafka transaction is
        committed if the database committed its state, aborted otherwise.  The
        new producer fences every older instance.  Idempotent: recovering again
        finds nothing open.  A row lock held by another instance past the
        lock timeout raises :class:`StateRowLockedError` before anything changed.

        If Kafka had aborted the transaction the database committed (heuristic
        outcome): with ``retain_records=True`` its records are re-published
        in a new two-phase transaction and the result says how many; otherwise
        ``on_heuristic`` decides (see :data:`OnHeuristic`): ``"raise"``
        :class:`~kafka2pc.HeuristicOutcomeError` (default, after logging the
        transactional id, the stored state and what to do), ``"report"`` it in
        the result, or ``"acknowledge"`` it: log its details once more, clear
        the stored state and report ``result.acknowledged``.  Until it is
        acknowledged every recovery finds it again.  The writer is ready for
        new work either way.  ``raise_on_heuristic`` and
        ``acknowledge_heuristic`` are the deprecated 0.1 flags.

        The result's :attr:`~RecoveryResult.decision` says what was done to
        the open transaction, :attr:`~RecoveryResult.ok` whether all is well.

        Example::

            result = writer.recover()
            if result.decision is not Decision.NOTHING:
                logger.info("settled the previous transaction: %s", result.decision.value)
        """
        raise_, acknowledge = heuristic_flags(f"{type(self).__name__}.recover", on_heuristic,
                                              raise_on_heuristic, acknowledge_heuristic)
        return self._runner.recover(raise_on_heuristic=raise_, acknowledge=acknowledge)

    @contextmanager
    def transaction(self, bind: Bind) -> Iterator[DualWriteTransaction]:
        """Run one atomic database + Kafka transaction on ``bind`` (a Session or a Connection).

        The database transaction is begun here (or the one ``bind`` already
        has is adopted) and committed on a normal exit of the block; an
        exception in the block rolls back both sides and propagates.  Runs
        :meth:`recover` first if it was never run or a previous failure left
        the outcome open.  Raises :class:`~kafka2pc.ProducerFencedError` when
        another instance took over the transactional id (whatever step that
        happened at), :class:`TransactionMisuseError` when the block committed,
        rolled back or closed the bound database transaction, and
        :class:`~kafka2pc.IndefiniteOutcomeError` when the database commit's
        outcome cannot be read back (the Kafka transaction then stays prepared
        until :meth:`recover`).
        """
        with self._runner.transaction(bind) as tx:
            yield tx

    def close(self, timeout: float | None = None) -> None:
        """Release the producer.  A prepared transaction is left for the next :meth:`recover`.

        If the last abort ran with records still in flight, the coordinator
        is asked first and a transaction it still holds open is aborted,
        within ``timeout`` seconds (``None``: ``kafka_timeout_s``, else
        :data:`~kafka2pc.DEFAULT_CLOSE_TIMEOUT_S`).
        """
        core = self._core
        if timeout is not None and timeout < 0:
            raise UsageError(f"close(timeout={timeout}): a timeout is in seconds and not negative")
        producer = core.take_producer()
        if self._runner.in_forked_child():
            # The parent's producer: its threads are not in this process, its queue is the parent's.
            # Dropped unflushed (the parent, or the next owner's recovery, settles what it holds).
            core.abandon()
            return
        if core.status is not WriterState.RECOVERING:  # a recovery in another thread ends by itself
            core.to(WriterState.CLOSED)
        if producer is not None:
            try:
                producer.close(timeout if timeout is not None else core.kafka_timeout_s or DEFAULT_CLOSE_TIMEOUT_S)
            except Exception:  # a fenced producer's flush raises; there is nothing left to release
                logger.debug("%s: closing the producer failed", core.tid, exc_info=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def writer_on(
    runtime: Runtime, engine: sa.Engine, producer_config: Mapping[str, Any], options: WriterOptions, *,
    state_table: sa.Table | None = None, outbox_table: sa.Table | None = None, listeners: Listeners | None = None,
) -> tuple[DualWriter, TransactionRunner]:
    """A :class:`DualWriter` that waits through ``runtime``, and its runner (how the pool and the asyncio twins
    make theirs; the pool runs its transactions and recoveries through the runner)."""
    writer = DualWriter.__new__(DualWriter)
    writer._setup(engine, producer_config, options, runtime, state_table, outbox_table,
                  listeners if listeners is not None else Listeners(options.on_step))
    return writer, writer._runner


def recover_all(writers: Iterable[DualWriter], *, max_workers: int | None = None) -> dict[str, RecoveryResult]:
    """Recover many writers (one per instance or shard) in parallel; never raises.

    Returns one :class:`RecoveryResult` per transactional id.  A heuristic
    outcome is reported in the result (``result.heuristic``), any other
    failure in ``result.error``, so that one stuck shard does not hide the
    others: check both before starting work.
    """
    items = list(writers)
    if not items:
        return {}

    def one(writer: DualWriter) -> RecoveryResult:
        try:
            return writer.recover(on_heuristic="report")
        except Exception as exc:  # noqa: BLE001 - reported per id
            logger.error("recovery of %r failed: %s", writer.transactional_id, exc)
            return RecoveryResult(writer.transactional_id, PreparedTxnState(), None, error=exc)

    with ThreadPoolExecutor(max_workers=max_workers or min(8, len(items)), thread_name_prefix="k2pc-recover") as pool:
        return {r.transactional_id: r for r in pool.map(one, items)}
