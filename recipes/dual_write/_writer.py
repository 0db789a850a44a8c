"""The writer: :class:`DualWriter` (normal path and recovery) and :func:`recover_all`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kafka2pc import (
    DEFAULT_CLOSE_TIMEOUT_S,
    IllegalStateError,
    Kafka2pcError,
    PreparedTxnState,
    ProducerFencedError,
    TxnState,
    UsageError,
)
from kafka2pc._deprecation import deprecated_property, seconds_from_ms

from ._bind import Bind, Bound
from ._bind import bind as bind_target
from ._handle import DualWriteTransaction
from ._lifecycle import WriterState
from ._schema import create_state_table
from ._schema import define_outbox_table as _make_outbox_table
from ._schema import define_state_table as _make_state_table
from ._settle import Settling
from ._store import StateStore, TakenOver, locked, store_for
from ._topics import TopicCheck
from ._values import (
    DualWriteMetrics,
    OnHeuristic,
    RecoveryResult,
    Step,
    StepHook,
    TransactionMisuseError,
    heuristic_flags,
)

if TYPE_CHECKING:
    from typing_extensions import Self

    from kafka2pc import TwoPhaseCommitProducer

__all__ = ["DualWriter", "recover_all"]

logger = logging.getLogger(__name__)

DeferCommit = Callable[[Callable[[], None]], None]
"""Receives the call that commits Kafka after the database COMMIT, to run it later (pipelined commit)."""


class DualWriter(Settling):
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
        settle_attempts: int = 5,
        queue_full_timeout_s: float = 60.0,
        kafka_timeout_s: float | None = None,
        lock_timeout_ms: int | None = None,
    ) -> None:
        lock_timeout_s = seconds_from_ms(type(self).__name__, "lock_timeout_ms", lock_timeout_ms,
                                         "lock_timeout_s", lock_timeout_s)
        if lock_timeout_s is not None and lock_timeout_s <= 0:
            raise UsageError("lock_timeout_s must be positive (or None for the database's own limit)")
        tid = producer_config.get("transactional.id")
        if not isinstance(tid, str) or not tid:
            raise UsageError("producer_config must set 'transactional.id' to a non-empty string")
        if len(tid) > 255:
            raise UsageError("transactional.id must fit the state table's VARCHAR(255)")
        if settle_attempts < 1:
            raise UsageError("settle_attempts must be at least 1")
        self._engine = engine
        self._config = dict(producer_config)
        self._tid = tid
        metadata = sa.MetaData()
        self._table = state_table if state_table is not None else _make_state_table(metadata)
        if retain_records and outbox_table is None:
            outbox_table = _make_outbox_table(metadata)
        self._outbox = outbox_table
        self._retain = retain_records
        self._lock_timeout_s = lock_timeout_s
        self._on_step = on_step
        self._step_observers: list[Callable[[Any, Step], None]] = []
        self._settle_attempts = settle_attempts
        self._queue_full_timeout_s = queue_full_timeout_s
        if kafka_timeout_s is not None and kafka_timeout_s <= 0:
            raise UsageError("kafka_timeout_s must be positive (or None to wait as librdkafka does)")
        self._kafka_timeout_s = kafka_timeout_s
        self._store: StateStore = store_for(engine.dialect, self._table)
        self._serial = threading.Lock()
        self._owner: int | None = None
        self._status = WriterState.NEW
        self._producer: TwoPhaseCommitProducer | None = None
        # The state row as this writer (or its recovery) last committed it: its stored
        # state and its version token (see ``_store``).  Valid while READY.
        self._last_state: str | None = None
        self._token: str | None = None
        self._outbox_dirty = True  # the outbox may hold rows of this id (deleted by the next transaction)
        self._open_since: float | None = None
        self._in_doubt: PreparedTxnState | None = None
        self._in_doubt_since: float | None = None
        self._committed = 0
        self._rolled_back = 0
        self._recoveries = 0
        self._heuristics = 0
        self._republished = 0
        # A new topic's metadata lookup is one of the transaction's Kafka calls: bounded by kafka_timeout_s too.
        self._topics = TopicCheck(self._config, timeout_s=kafka_timeout_s if kafka_timeout_s is not None else 10.0)

    # -- introspection -------------------------------------------------------------
    @property
    def transactional_id(self) -> str:
        """The Kafka transactional id (and the state row's key)."""
        return self._tid

    @property
    def state_table(self) -> sa.Table:
        """The state table this writer locks and updates."""
        return self._table

    @property
    def outbox_table(self) -> sa.Table | None:
        """The outbox table (``None`` unless configured or ``retain_records=True``)."""
        return self._outbox

    @property
    def retain_records(self) -> bool:
        """Whether records are kept in the outbox until Kafka commits them."""
        return self._retain

    @property
    def producer(self) -> TwoPhaseCommitProducer | None:
        """The current producer (``None`` before the first recovery)."""
        return self._producer

    @property
    def fenced(self) -> bool:
        """True once another instance took over this transactional id; only :meth:`recover` resets it."""
        return self._status is WriterState.FENCED

    @property
    def state(self) -> WriterState:
        """Where the writer is in its life cycle (as :attr:`kafka2pc.TwoPhaseCommitProducer.state` for the producer)."""
        return self._status

    status = deprecated_property("status", "state", lambda self: self._status)

    @property
    def engine(self) -> sa.Engine:
        """The database holding the state table."""
        return self._engine

    def create_tables(self) -> None:
        """Create the state (and outbox) table if missing: a convenience for scripts and tests."""
        create_state_table(self._engine, self._table)
        if self._outbox is not None:
            self._outbox.create(self._engine, checkfirst=True)

    def metrics(self) -> DualWriteMetrics:
        """A snapshot of this writer's gauges and counters (no I/O; safe from any thread)."""
        now = time.monotonic()
        starts = [t for t in (self._open_since, self._in_doubt_since) if t is not None]
        return DualWriteMetrics(
            writers=1,
            oldest_open_transaction_age_s=(now - min(starts)) if starts else None,
            in_doubt_transactions=1 if self._in_doubt is not None else 0,
            transactions_committed=self._committed,
            transactions_rolled_back=self._rolled_back,
            recoveries=self._recoveries,
            heuristic_outcomes=self._heuristics,
            records_republished=self._republished,
        )

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
            return self._recover(raise_on_heuristic=raise_, acknowledge=acknowledge)

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
            bound = bind_target(bind, self._tid)
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
            bound = bind_target(bind, self._tid)
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
        if timeout is not None and timeout < 0:
            raise UsageError(f"close(timeout={timeout}): a timeout is in seconds and not negative")
        producer, self._producer = self._producer, None
        if self._status is not WriterState.RECOVERING:  # a recovery in another thread ends by itself
            self._to(WriterState.CLOSED)
        if producer is not None:
            try:
                producer.close(timeout if timeout is not None else self._kafka_timeout_s or DEFAULT_CLOSE_TIMEOUT_S)
            except Exception:  # a fenced producer's flush raises; there is nothing left to release
                logger.debug("%s: closing the producer failed", self._tid, exc_info=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- state -----------------------------------------------------------------------
    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        if self._owner == threading.get_ident():
            raise IllegalStateError(f"{self._tid!r}: transaction() and recover() cannot be nested")
        with self._serial:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def _ensure_ready(self, ready_by: float | None = None) -> None:
        """Recover first if needed, within ``kafka_timeout_s`` (and by ``ready_by``, a ``time.monotonic()``).

        A recovery that cannot finish in time (the broker is down) raises a
        typed error and leaves the writer ``NEEDS_RECOVERY``: the next call
        tries again, so the writer heals once the broker is back.
        """
        if self._status is WriterState.FENCED:
            raise ProducerFencedError(
                f"{self._tid!r} was taken over by another instance; call recover() only if that one is gone"
            )
        producer = self._producer
        if self._status is not WriterState.READY or producer is None or producer.state is not TxnState.READY:
            deadline = self._kafka_deadline()
            if ready_by is not None:
                deadline = ready_by if deadline is None else min(deadline, ready_by)
            self._recover(raise_on_heuristic=True, acknowledge=False, deadline=deadline)

    def _recover_by(self, deadline: float | None) -> RecoveryResult:
        """:meth:`recover` (``raise_on_heuristic=False``), every Kafka call ending by ``deadline`` (for the pool)."""
        with self._exclusive():
            return self._recover(raise_on_heuristic=False, acknowledge=False, deadline=deadline)

    def _require_producer(self) -> TwoPhaseCommitProducer:
        if self._producer is None:
            raise IllegalStateError(f"{self._tid!r}: no producer; call recover() first")
        return self._producer

    # -- normal path -----------------------------------------------------------------
    def _run(
        self, bound: Bound, producer: TwoPhaseCommitProducer, defer: DeferCommit | None = None
    ) -> Iterator[DualWriteTransaction]:
        conn = bound.connection
        tx = DualWriteTransaction(self, producer, conn)
        if self._token is None:
            raise IllegalStateError(f"{self._tid!r}: no state row token; call recover() first")
        token: str = self._token
        self._to(WriterState.IN_TRANSACTION)
        self._open_since = time.monotonic()
        kafka_begun = combined = cleaned = False
        store = self._store
        try:
            entered: str = locked(store, self._tid, "begin a transaction",
                                  lambda: store.enter(conn, self._tid, token, lock_timeout_s=self._lock_timeout_s))
            token = entered
            if self._retain and self._outbox_dirty:
                locked(store, self._tid, "begin a transaction (drop spent outbox rows)",
                       lambda: self._delete_outbox(conn))
                cleaned = True
            self._step(Step.DB_BEGUN)
            self._kafka(producer.begin_transaction)
            kafka_begun = True
            self._step(Step.KAFKA_BEGUN)
            yield tx
            if bound.misuse is None:
                bound.flush()
            if bound.misuse is not None:
                raise bound.misuse_error()
            self._step(Step.BODY_DONE)
            state = self._kafka(lambda: producer.prepare_transaction(self._kafka_timeout_s))
            tx._prepared = state
            self._step(Step.PREPARED)
            if self._retain:
                self._insert_outbox(conn, state, tx._records)
            # PostgreSQL over psycopg 3 with a Connection: the state update goes with the
            # COMMIT in one round trip (store_and_commit); Steps as if they were two.
            combined = store.combined_commit and not bound.session
            if not combined:
                token = store.store(conn, self._tid, str(state), token, self._last_state)
            self._step(Step.STATE_STORED)
            self._step(Step.DB_COMMITTING)
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
        self._rolled_back += 1
        try:
            bound.rollback()
        except Exception:  # the server rolls back a dead connection's transaction by itself
            logger.warning("%s: database rollback failed", self._tid, exc_info=True)
        fenced = isinstance(cause, (TakenOver, ProducerFencedError))
        if producer is not None:
            try:
                self._kafka(lambda: producer.abort_transaction(self._kafka_timeout_s))
            except Kafka2pcError as exc:
                # The database rolled back, so abort is the only right outcome; the next
                # recovery aborts whatever is still open (the stored state is not this one).
                fenced = fenced or isinstance(exc, ProducerFencedError)
                logger.warning("%s: abort after %r failed (%s)", self._tid, cause, exc)
        if not fenced and isinstance(cause, Kafka2pcError) and not isinstance(cause, UsageError):
            fenced = self._taken_over_now()  # e.g. a fenced producer's flush that failed oddly
        if fenced:
            return self._fenced_error("the state row changed since this writer last wrote it"
                                      if isinstance(cause, TakenOver) else f"the transaction failed ({cause!r})")
        settled = producer is None or producer.state is TxnState.READY
        self._to(WriterState.READY if settled else WriterState.NEEDS_RECOVERY)
        if (bound.misuse is not None and not bound.misuse_while_failing and isinstance(cause, Exception)
                and not isinstance(cause, TransactionMisuseError)):
            return bound.misuse_error()  # e.g. ResourceClosedError after a close() in the block
        return cause

    def _finish(
        self, bound: Bound, producer: TwoPhaseCommitProducer, state: PreparedTxnState,
        token: str, combined: bool, cleaned: bool, defer: DeferCommit | None = None,
    ) -> None:
        try:
            if combined:
                token = self._store.store_and_commit(bound.connection, self._tid, str(state), token, self._last_state)
            bound.commit()  # after store_and_commit: bookkeeping only, psycopg sends nothing
        except TakenOver as exc:  # the guarded update failed: nothing committed
            raise self._fail(bound, producer, exc) from exc
        except BaseException as exc:
            if not self._settle_unknown_db_commit(bound, producer, state, exc):
                self._rolled_back += 1
                raise
            self._committed += 1
            return
        self._token = token
        self._last_state = str(state)
        self._outbox_dirty = self._retain or (self._outbox_dirty and not cleaned)
        self._step(Step.DB_COMMITTED)
        if defer is not None:
            defer(lambda: self._commit_kafka(producer, state))
            return
        self._commit_kafka(producer, state)

    def _commit_kafka(self, producer: TwoPhaseCommitProducer, state: PreparedTxnState) -> None:
        """Step 7, once the database committed ``state``: commit Kafka, or settle a failure (never guess)."""
        deadline = self._kafka_deadline()  # the commit and any settlement after it end by then
        try:
            self._kafka(lambda: producer.commit_transaction(self._kafka_timeout_s))
        except Kafka2pcError as exc:
            self._after_kafka_commit_failure(producer, state, exc, deadline)
        else:
            self._to(WriterState.READY)
        self._committed += 1
        self._step(Step.KAFKA_COMMITTED)


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
