"""The writer: :class:`DualWriter` (normal path and recovery) and :func:`recover_all`."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy as sa

from kafka2pc import (
    DEFAULT_CLOSE_TIMEOUT_S,
    ForkedProcessError,
    IllegalStateError,
    Kafka2pcError,
    OnHeuristic,
    PreparedTxnState,
    ProducerFencedError,
    TxnState,
    UsageError,
)
from kafka2pc._deprecation import deprecated_property, seconds_from_ms

from ._bind import Bind, Bound
from ._bind import bind as bind_target
from ._core import WriterCore
from ._events import EVENTS, Listeners, StepListener
from ._handle import DualWriteTransaction
from ._lifecycle import WriterState
from ._options import DEFAULT_QUEUE_FULL_TIMEOUT_S, DEFAULT_SETTLE_ATTEMPTS, WriterOptions, options_from
from ._recovery import Recovery
from ._runtime import THREADS, forks_seen
from ._schema import create_state_table
from ._schema import define_outbox_table as _make_outbox_table
from ._schema import define_state_table as _make_state_table
from ._settle import Settler
from ._store import TakenOver, locked
from ._values import (
    DualWriteMetrics,
    RecoveryResult,
    Step,
    StepHook,
    TransactionMisuseError,
    heuristic_flags,
)

if TYPE_CHECKING:
    from typing_extensions import Self

    from kafka2pc import TwoPhaseCommitProducer

    from ._runtime import Runtime

__all__ = ["DualWriter", "recover_all", "writer_on"]

logger = logging.getLogger(__name__)

DeferCommit = Callable[[Callable[[], None]], None]
"""Receives the call that commits Kafka after the database COMMIT, to run it later (pipelined commit)."""


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
        self._settler = Settler(self._core, self._recovery)
        self._serial = threading.Lock()
        self._holder: int | None = None
        """The thread running a transaction or a recovery now (nesting is refused)."""
        self._open_since: float | None = None
        self._committed = 0
        self._rolled_back = 0
        self._pid = os.getpid()
        """The process that made the writer."""
        self._forks = forks_seen()
        """:func:`forks_seen` when the writer was made: another value means this is a forked child."""

    def _forked_error(self) -> ForkedProcessError:
        return ForkedProcessError(
            f"{self._core.tid!r}: this DualWriter was made in process {self._pid} and is used in its forked child "
            f"{os.getpid()}: its producer and connections do not survive a fork, and its transactional id is "
            "one process's (two children cannot both use it). Make the writer after the fork (gunicorn's "
            "post_worker_init, Celery's worker_process_init, uWSGI's postfork), or use a WriterPool, which remakes "
            "itself in the child", pid=self._pid,
        )

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
        starts = [t for t in (self._open_since, self._core.in_doubt_since) if t is not None]
        return DualWriteMetrics(
            writers=1,
            oldest_open_transaction_age_s=(now - min(starts)) if starts else None,
            in_doubt_transactions=1 if self._core.in_doubt is not None else 0,
            transactions_committed=self._committed,
            transactions_rolled_back=self._rolled_back,
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
        with self._exclusive():
            return self._recovery.recover(raise_on_heuristic=raise_, acknowledge=acknowledge)

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
        with self._exclusive():
            self._ensure_ready()
            bound = bind_target(bind, self._core.tid)
            bound.install()
            try:
                yield from self._run(bound, self._require_producer())
            finally:
                bound.remove()

    @contextmanager
    def _transaction_deferred(
        self, bind: Bind, defer: DeferCommit | None, *, ready_by: float | None = None
    ) -> Iterator[DualWriteTransaction]:
        """:meth:`transaction`, but the Kafka commit after the database COMMIT is handed to ``defer``.

        For :class:`WriterPool`'s pipelined commit: ``defer`` receives the
        call that commits Kafka (and settles a failure like :meth:`transaction`
        does) and runs it later, in another thread.  Until that call returned
        the writer stays ``IN_TRANSACTION``: the caller must not start another
        transaction on it before.  If the block fails before the database
        COMMIT, ``defer`` is not called; without ``defer`` this is
        :meth:`transaction`.  ``ready_by`` (``time.monotonic()``) also bounds
        the recovery run first (the pool's ``acquire_timeout_s``).
        """
        with self._exclusive():
            self._ensure_ready(ready_by)
            bound = bind_target(bind, self._core.tid)
            bound.install()
            try:
                yield from self._run(bound, self._require_producer(), defer)
            finally:
                bound.remove()

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
        if self._forks != forks_seen():
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

    # -- state -----------------------------------------------------------------------
    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        if self._forks != forks_seen():
            raise self._forked_error()
        if self._holder == threading.get_ident():
            raise IllegalStateError(f"{self._core.tid!r}: transaction() and recover() cannot be nested")
        with self._serial:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    def _ensure_ready(self, ready_by: float | None = None) -> None:
        """Recover first if needed, within ``kafka_timeout_s`` (and by ``ready_by``, a ``time.monotonic()``).

        A recovery that cannot finish in time (the broker is down) raises a
        typed error and leaves the writer ``NEEDS_RECOVERY``: the next call
        tries again, so the writer heals once the broker is back.
        """
        if self._core.status is WriterState.FENCED:
            raise ProducerFencedError(
                f"{self._core.tid!r} was taken over by another instance; call recover() only if that one is gone"
            )
        producer = self._core.producer
        if self._core.status is not WriterState.READY or producer is None or producer.state is not TxnState.READY:
            self._recovery.recover(raise_on_heuristic=True, acknowledge=False, deadline=self._deadline(ready_by))

    def _deadline(self, ready_by: float | None) -> float | None:
        """When a recovery starting now must end: ``kafka_timeout_s`` from now, and by ``ready_by``."""
        deadline = self._settler.kafka_deadline()
        if ready_by is not None:
            deadline = ready_by if deadline is None else min(deadline, ready_by)
        return deadline

    def _recover_by(self, ready_by: float | None) -> RecoveryResult:
        """:meth:`recover` (``raise_on_heuristic=False``), every Kafka call ending within ``kafka_timeout_s``
        and by ``ready_by`` (a ``time.monotonic()`` value; the pool's ``acquire_timeout_s``)."""
        with self._exclusive():
            return self._recovery.recover(raise_on_heuristic=False, acknowledge=False,
                                          deadline=self._deadline(ready_by))

    def _require_producer(self) -> TwoPhaseCommitProducer:
        if self._core.producer is None:
            raise IllegalStateError(f"{self._core.tid!r}: no producer; call recover() first")
        return self._core.producer

    # -- normal path -----------------------------------------------------------------
    def _run(
        self, bound: Bound, producer: TwoPhaseCommitProducer, defer: DeferCommit | None = None
    ) -> Iterator[DualWriteTransaction]:
        core = self._core
        conn = bound.connection
        tx = DualWriteTransaction(self._core, producer, conn)
        if core.token is None:
            raise IllegalStateError(f"{core.tid!r}: no state row token; call recover() first")
        token: str = core.token
        core.to(WriterState.IN_TRANSACTION)
        self._open_since = time.monotonic()
        kafka_begun = combined = cleaned = False
        store = core.store
        try:
            entered: str = locked(store, core.tid, "begin a transaction",
                                  lambda: store.enter(conn, core.tid, token, lock_timeout_s=core.lock_timeout_s))
            token = entered
            if core.retain and core.outbox_dirty:
                locked(store, core.tid, "begin a transaction (drop spent outbox rows)",
                       lambda: core.delete_outbox(conn))
                cleaned = True
            core.step(Step.DB_BEGUN)
            core.kafka(producer.begin_transaction)
            kafka_begun = True
            core.step(Step.KAFKA_BEGUN)
            yield tx
            if bound.misuse is None:
                bound.flush()
            if bound.misuse is not None:
                raise bound.misuse_error()
            core.step(Step.BODY_DONE)
            state = core.kafka(lambda: producer.prepare_transaction(core.kafka_timeout_s))
            tx._prepared = state
            core.step(Step.PREPARED)
            if core.retain:
                core.insert_outbox(conn, state, tx._records)
            # PostgreSQL over psycopg 3 with a Connection, or a Session whose commit() would write
            # nothing more: the state update goes with the COMMIT in one round trip
            # (store_and_commit); Steps as if they were two.
            combined = store.combined_commit and bound.commits_alone()
            if not combined:
                token = store.store(conn, core.tid, str(state), token, core.last_state)
            core.step(Step.STATE_STORED)
            core.step(Step.DB_COMMITTING)
        except BaseException as exc:
            self._open_since = None
            error = self._fail(bound, producer if kafka_begun else None, exc)
            if error is exc:
                raise
            raise error from exc
        try:
            self._finish(bound, producer, state, token, combined, cleaned, defer)
        finally:
            self._open_since = None

    def _fail(self, bound: Bound, producer: TwoPhaseCommitProducer | None, cause: BaseException) -> BaseException:
        """Roll back both sides after ``cause``; return the error to raise (``cause`` or a clearer one)."""
        core = self._core
        self._rolled_back += 1
        try:
            bound.rollback()
        except Exception:  # the server rolls back a dead connection's transaction by itself
            logger.warning("%s: database rollback failed", core.tid, exc_info=True)
        fenced = isinstance(cause, (TakenOver, ProducerFencedError))
        if producer is not None:
            try:
                core.kafka(lambda: producer.abort_transaction(core.kafka_timeout_s))
            except Kafka2pcError as exc:
                # The database rolled back, so abort is the only right outcome; the next
                # recovery aborts whatever is still open (the stored state is not this one).
                fenced = fenced or isinstance(exc, ProducerFencedError)
                logger.warning("%s: abort after %r failed (%s)", core.tid, cause, exc)
        if not fenced and isinstance(cause, Kafka2pcError) and not isinstance(cause, UsageError):
            fenced = core.taken_over_now()  # e.g. a fenced producer's flush that failed oddly
        if fenced:
            return core.fenced_error("the state row changed since this writer last wrote it"
                                      if isinstance(cause, TakenOver) else f"the transaction failed ({cause!r})")
        settled = producer is None or producer.state is TxnState.READY
        core.to(WriterState.READY if settled else WriterState.NEEDS_RECOVERY)
        if (bound.misuse is not None and not bound.misuse_while_failing and isinstance(cause, Exception)
                and not isinstance(cause, TransactionMisuseError)):
            return bound.misuse_error()  # e.g. ResourceClosedError after a close() in the block
        return cause

    def _finish(
        self, bound: Bound, producer: TwoPhaseCommitProducer, state: PreparedTxnState,
        token: str, combined: bool, cleaned: bool, defer: DeferCommit | None = None,
    ) -> None:
        core = self._core
        try:
            if combined:
                token = core.store.store_and_commit(bound.connection, core.tid, str(state), token, core.last_state)
            bound.commit()  # after store_and_commit: bookkeeping only, psycopg sends nothing
        except TakenOver as exc:  # the guarded update failed: nothing committed
            raise self._fail(bound, producer, exc) from exc
        except BaseException as exc:
            if not self._settler.settle_unknown_db_commit(bound, producer, state, exc):
                self._rolled_back += 1
                raise
            self._committed += 1
            return
        core.wrote(str(state), token)
        core.mark_outbox(core.retain or (core.outbox_dirty and not cleaned))
        core.step(Step.DB_COMMITTED)
        if defer is not None:
            defer(lambda: self._commit_kafka(producer, state))
            return
        self._commit_kafka(producer, state)

    def _commit_kafka(self, producer: TwoPhaseCommitProducer, state: PreparedTxnState) -> None:
        """Step 7, once the database committed ``state``: commit Kafka, or settle a failure (never guess)."""
        core = self._core
        deadline = self._settler.kafka_deadline()  # the commit and any settlement after it end by then
        try:
            core.kafka(lambda: producer.commit_transaction(core.kafka_timeout_s))
        except Kafka2pcError as exc:
            self._settler.after_kafka_commit_failure(producer, state, exc, deadline)
        else:
            core.to(WriterState.READY)
        self._committed += 1
        core.step(Step.KAFKA_COMMITTED)


def writer_on(
    runtime: Runtime, engine: sa.Engine, producer_config: Mapping[str, Any], options: WriterOptions, *,
    state_table: sa.Table | None = None, outbox_table: sa.Table | None = None, listeners: Listeners | None = None,
) -> DualWriter:
    """A :class:`DualWriter` that waits through ``runtime`` (how the pool and the asyncio twins make theirs)."""
    writer = DualWriter.__new__(DualWriter)
    writer._setup(engine, producer_config, options, runtime, state_table, outbox_table,
                  listeners if listeners is not None else Listeners(options.on_step))
    return writer


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
