"""How a :class:`DualWriter` runs its work: one transaction or recovery at a time, the normal path's steps.

The writer holds one :class:`TransactionRunner` and forwards :meth:`DualWriter.transaction` and
:meth:`DualWriter.recover` to it; a :class:`WriterPool` gets the runner of each writer it makes (from
:func:`~._writer.writer_on`) and calls it by its public names: a transaction whose Kafka commit is
deferred to the commit pipeline, a recovery bounded by the pool's ``acquire_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kafka2pc import (
    ForkedProcessError,
    IllegalStateError,
    Kafka2pcError,
    PreparedTxnState,
    ProducerFencedError,
    TxnState,
    UsageError,
)

from ._bind import Bind, Bound
from ._bind import bind as bind_target
from ._handle import DualWriteTransaction, open_handle
from ._lifecycle import WriterState
from ._runtime import forks_seen
from ._store import TakenOver, locked
from ._values import RecoveryResult, Step, TransactionMisuseError

if TYPE_CHECKING:
    from kafka2pc import TwoPhaseCommitProducer

    from ._core import WriterCore
    from ._recovery import Recovery
    from ._settle import Settler

__all__ = ["DeferCommit", "TransactionRunner"]

logger = logging.getLogger("kafka2pc.recipes.dual_write._writer")  # the writer's logger, as before the split

DeferCommit = Callable[[Callable[[], None]], None]
"""Receives the call that commits Kafka after the database COMMIT, to run it later (pipelined commit)."""


class TransactionRunner:
    """One writer's transactions and recoveries, one at a time, in the process that made it.

    Owns the writer's serial lock, the counters :meth:`DualWriter.metrics`
    reads (:attr:`committed`, :attr:`rolled_back`, :attr:`open_since`) and
    the normal path (steps 1-7); the core (:class:`WriterCore`), the
    recovery and the settler are collaborators it is given.
    """

    def __init__(self, core: WriterCore, recovery: Recovery, settler: Settler) -> None:
        self._core = core
        self._recovery = recovery
        self._settler = settler
        self._serial = _Serial()
        """Held by the thread running a transaction or a recovery now (nesting is refused)."""
        self.open_since: float | None = None
        """``time.monotonic()`` when the open transaction began (``None``: none open)."""
        self.committed = 0
        self.rolled_back = 0
        self._pid = os.getpid()
        """The process that made the writer."""
        self._forks = forks_seen()
        """:func:`forks_seen` when the writer was made: another value means this is a forked child."""

    def in_forked_child(self) -> bool:
        """True in a process forked after the writer was made (its producer and connections are the parent's)."""
        return self._forks != forks_seen()

    def _forked_error(self) -> ForkedProcessError:
        return ForkedProcessError(
            f"{self._core.tid!r}: this DualWriter was made in process {self._pid} and is used in its forked child "
            f"{os.getpid()}: its producer and connections do not survive a fork, and its transactional id is "
            "one process's (two children cannot both use it). Make the writer after the fork (gunicorn's "
            "post_worker_init, Celery's worker_process_init, uWSGI's postfork), or use a WriterPool, which remakes "
            "itself in the child", pid=self._pid,
        )

    @contextmanager
    def transaction(
        self, bind: Bind, defer: DeferCommit | None = None, *, ready_by: float | None = None
    ) -> Iterator[DualWriteTransaction]:
        """:meth:`DualWriter.transaction`; with ``defer``, the Kafka commit after the database COMMIT is handed to it.

        For :class:`WriterPool`'s pipelined commit: ``defer`` receives the
        call that commits Kafka (and settles a failure like the writer's
        transaction does) and runs it later, in another thread.  Until that
        call returned the writer stays ``IN_TRANSACTION``: the caller must not
        start another transaction on it before.  If the block fails before
        the database COMMIT, ``defer`` is not called.  ``ready_by``
        (``time.monotonic()``) also bounds the recovery run first (the pool's
        ``acquire_timeout_s``).
        """
        with self._exclusive():
            self._ensure_ready(ready_by)
            bound = bind_target(bind, self._core.tid)
            bound.install()
            try:
                yield from self._run(bound, self._require_producer(), defer)
            finally:
                bound.remove()

    def recover(self, *, raise_on_heuristic: bool, acknowledge: bool) -> RecoveryResult:
        """:meth:`DualWriter.recover` with its flags resolved."""
        with self._exclusive():
            return self._recovery.recover(raise_on_heuristic=raise_on_heuristic, acknowledge=acknowledge)

    def _exclusive(self) -> _Serial:
        """Held while one transaction or recovery runs: refused in a forked child and when nested."""
        if self._forks != forks_seen():
            raise self._forked_error()
        if self._serial.holder == threading.get_ident():
            raise IllegalStateError(f"{self._core.tid!r}: transaction() and recover() cannot be nested")
        return self._serial

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

    def recover_by(self, ready_by: float | None) -> RecoveryResult:
        """:meth:`DualWriter.recover` (``raise_on_heuristic=False``), every Kafka call ending within ``kafka_timeout_s``
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
        tx, contents = open_handle(self._core, producer, conn)
        if core.token is None:
            raise IllegalStateError(f"{core.tid!r}: no state row token; call recover() first")
        token: str = core.token
        core.to(WriterState.IN_TRANSACTION)
        self.open_since = time.monotonic()
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
            contents.prepared = state
            core.step(Step.PREPARED)
            if core.retain:
                core.insert_outbox(conn, state, contents.records)
            # PostgreSQL over psycopg 3 with a Connection, or a Session whose commit() would write
            # nothing more: the state update goes with the COMMIT in one round trip
            # (store_and_commit); Steps as if they were two.
            combined = store.combined_commit and bound.commits_alone()
            if not combined:
                token = store.store(conn, core.tid, str(state), token, core.last_state)
            core.step(Step.STATE_STORED)
            core.step(Step.DB_COMMITTING)
        except BaseException as exc:
            self.open_since = None
            error = self._fail(bound, producer if kafka_begun else None, exc)
            if error is exc:
                raise
            raise error from exc
        try:
            self._finish(bound, producer, state, token, combined, cleaned, defer)
        finally:
            self.open_since = None

    def _fail(self, bound: Bound, producer: TwoPhaseCommitProducer | None, cause: BaseException) -> BaseException:
        """Roll back both sides after ``cause``; return the error to raise (``cause`` or a clearer one)."""
        core = self._core
        self.rolled_back += 1
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
        stored = str(state)
        try:
            if combined:
                token = core.store.store_and_commit(bound.connection, core.tid, stored, token, core.last_state)
            bound.commit()  # after store_and_commit: bookkeeping only, psycopg sends nothing
        except TakenOver as exc:  # the guarded update failed: nothing committed
            raise self._fail(bound, producer, exc) from exc
        except BaseException as exc:
            if not self._settler.settle_unknown_db_commit(bound, producer, state, exc):
                self.rolled_back += 1
                raise
            self.committed += 1
            return
        core.wrote(stored, token)
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
        self.committed += 1
        core.step(Step.KAFKA_COMMITTED)



class _Serial:
    """One transaction or recovery at a time, and which thread runs it (a plain context manager)."""

    __slots__ = ("_lock", "holder")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holder: int | None = None
        """The thread inside now (``None``: none)."""

    def __enter__(self) -> None:
        self._lock.acquire()
        self.holder = threading.get_ident()

    def __exit__(self, *exc_info: object) -> None:
        self.holder = None
        self._lock.release()
