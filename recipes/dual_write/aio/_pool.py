"""``AsyncWriterPool``: the writer pool for asyncio services (SQLAlchemy's asyncio extension).

The sync pool's code (:class:`~kafka2pc.recipes.dual_write.WriterPool`: leases,
fencing epochs, slot reuse, renewal, the orphan scan and its settling) runs
unchanged on the event loop, in SQLAlchemy's greenlet bridge as
:class:`AsyncDualWriter` runs the sync writer's (see ``_bridge.py``).  What
would block answers through the loop instead:

* the slots are :class:`_LoopWriter` s (the asyncio writer's sync half);
* the pool's condition (waiting for a free slot, for busy slots at close)
  and its stop signal are futures of the loop (:class:`_LoopCondition`,
  :class:`_LoopEvent`); the pool's lock is only ever held for in-memory work,
  between two waits, so the loop's single thread is all the exclusion it needs;
* the renewal and the orphan scan are tasks of the loop, not threads;
* orphans are settled ``settle_parallelism`` at a time by tasks, each with
  an :class:`~kafka2pc.aio.AsyncTransactionAdmin` of its own;
* a pipelined commit (``pipelined=True``) runs as a task of the loop
  (:class:`_LoopPipeline`), not on a worker thread.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal, cast

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from kafka2pc import IllegalStateError, PreparedTxnState, Settlement, TransactionDescription, UsageError
from kafka2pc._deprecation import seconds_from_ms
from kafka2pc.aio import AsyncTransactionAdmin

from .._lease import Lease
from .._orphans import _Admins
from .._pipeline import CommitPipeline
from .._pool import PoolMetrics, WriterPool
from .._values import RecoveryResult, StepHook
from ._bridge import in_greenlet, run_to_completion, wait_for
from ._writer import AsyncBind, AsyncDualWriteTransaction, _LoopWriter, _sync_target, run_scope

if TYPE_CHECKING:
    import threading

    from typing_extensions import Self

    from kafka2pc import TransactionAdmin

    from .._writer import DualWriter

__all__ = ["AsyncWriterPool"]

logger = logging.getLogger(__name__)


class _LoopCondition:
    """:class:`threading.Condition`'s interface for code running in greenlets on one loop's thread.

    Entering it takes nothing: the code inside never switches greenlets
    except in :meth:`wait`, so no other task runs in between.
    """

    def __init__(self) -> None:
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc_info: object) -> None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        """Inside the pool's greenlet: let the loop run until :meth:`notify` (True) or ``timeout`` (False)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            done, _ = wait_for(asyncio.wait({waiter}, timeout=timeout))
            return bool(done)
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def notify(self, n: int = 1) -> None:
        """Wake up to ``n`` waiters."""
        while n > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                n -= 1

    def notify_all(self) -> None:
        """Wake every waiter."""
        self.notify(len(self._waiters))


class _LoopEvent:
    """:class:`threading.Event`'s interface over an :class:`asyncio.Event` (``wait`` from a greenlet)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Inside the pool's greenlet: True once set, False after ``timeout``."""
        if not self._event.is_set():
            waiter = asyncio.ensure_future(self._event.wait())
            try:
                wait_for(asyncio.wait({waiter}, timeout=timeout))
            finally:
                waiter.cancel()
        return self._event.is_set()


class _LoopSemaphore:
    """:class:`threading.BoundedSemaphore`'s ``acquire``/``release`` for the pool's greenlets."""

    def __init__(self, value: int) -> None:
        self._semaphore = asyncio.BoundedSemaphore(value)

    def acquire(self) -> bool:
        """Inside a greenlet: let the loop run until a place is free."""
        return wait_for(self._semaphore.acquire())

    def release(self) -> None:
        self._semaphore.release()


class _LoopPipeline(CommitPipeline):
    """The pipelined commit on the loop: each Kafka commit runs in a task (a greenlet of its own)."""

    def __init__(self, max_in_flight: int, slow_commit_s: float) -> None:
        super().__init__(max_in_flight, slow_commit_s)
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        self._executor = None
        self._places = cast("threading.BoundedSemaphore", _LoopSemaphore(max_in_flight))
        self._tasks: set[asyncio.Task[None]] = set()

    def _new_event(self) -> _LoopEvent:
        return _LoopEvent()

    def _spawn(self, run: Callable[[], None]) -> None:
        task = asyncio.ensure_future(in_greenlet(run))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class _GreenletAdmin:
    """The :class:`~kafka2pc.TransactionAdmin` calls the pool settles orphans with, answered by an async admin."""

    def __init__(self, admin: AsyncTransactionAdmin) -> None:
        self._admin = admin

    def complete_transaction(
        self, transactional_id: str, state: PreparedTxnState, *, fence: bool = True,
        on_heuristic: Literal["raise", "report"] = "raise",
    ) -> Settlement:
        return wait_for(self._admin.complete_transaction(
            transactional_id, state, fence=fence, on_heuristic=on_heuristic))

    def force_terminate_transaction(self, transactional_id: str) -> TransactionDescription | None:
        return wait_for(self._admin.force_terminate_transaction(transactional_id))


class _LoopAdmins(_Admins):
    """One :class:`~kafka2pc.aio.AsyncTransactionAdmin` (one thread) per settling task."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self._by_task: dict[asyncio.Task[Any] | None, AsyncTransactionAdmin] = {}

    def get(self) -> TransactionAdmin:
        task = asyncio.current_task()
        admin = self._by_task.get(task)
        if admin is None:
            admin = self._by_task[task] = AsyncTransactionAdmin(self._config)
        return cast("TransactionAdmin", _GreenletAdmin(admin))

    def close(self) -> None:
        admins, self._by_task = list(self._by_task.values()), {}
        for admin in admins:
            wait_for(admin.close())


class _LoopPool(WriterPool):
    """The sync pool, unchanged, with its waits answered by the event loop (see the module docstring)."""

    _tasks: list[asyncio.Task[None]]

    def _new_writer(self, tid: str) -> DualWriter:
        writer = _LoopWriter(self._engine, {**self._config, "transactional.id": tid},
                             state_table=self._state_table, **self._writer_options)
        writer._step_observers = self._step_observers
        return writer

    def _new_condition(self) -> threading.Condition:
        return cast("threading.Condition", _LoopCondition())

    def _new_event(self) -> threading.Event:
        return cast("threading.Event", _LoopEvent())

    def _new_admins(self) -> _Admins:
        return _LoopAdmins(self._config)

    def _new_pipeline(self, max_in_flight: int, slow_commit_s: float) -> CommitPipeline:
        return _LoopPipeline(max_in_flight, slow_commit_s)

    def _start_background(self) -> None:
        self._tasks = [
            asyncio.ensure_future(in_greenlet(loop)) for loop in (self._renew_loop, self._orphan_loop)
        ]

    def _join_background(self, deadline: float) -> None:
        tasks = getattr(self, "_tasks", [])
        if not tasks:
            return
        _, pending = wait_for(asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic())))
        for task in pending:
            logger.warning("pool %r: a background task did not end in time: cancelling it", self._prefix)
            task.cancel()

    def _settle_each(self, leases: list[Lease], admins: _Admins) -> list[RecoveryResult | None]:
        if len(leases) == 1 or self._settle_parallelism == 1:
            return [self._settle_one(lease, admins) for lease in leases]
        found: list[RecoveryResult | None] = [None] * len(leases)
        todo = iter(enumerate(leases))

        async def settler() -> None:
            for i, lease in todo:  # the settlers share one iterator: each lease is settled once
                found[i] = await in_greenlet(self._settle_one, lease, admins)

        n = min(self._settle_parallelism, len(leases))
        errors = wait_for(asyncio.gather(*(settler() for _ in range(n)), return_exceptions=True))
        for error in errors:  # as the sync pool's executor: every settler ends, then the first error is raised
            if isinstance(error, BaseException):
                raise error
        return found


class AsyncWriterPool:
    """Dual writers for many asyncio instances sharing one database, with transactional ids from a leased set.

    The asyncio counterpart of :class:`~kafka2pc.recipes.dual_write.WriterPool`
    for an ``AsyncEngine`` (PostgreSQL through ``postgresql+psycopg://``,
    SQLite through ``sqlite+aiosqlite://``): the same arguments, lease table,
    fencing epochs, slots (one :class:`AsyncDualWriter` each, reused),
    renewal, orphan scan and settling, metrics and errors
    (:class:`~kafka2pc.recipes.dual_write.PoolExhaustedError`), since it runs
    the sync pool's code on the event loop (SQLAlchemy's greenlet bridge);
    the renewal and the orphan scan are tasks of the loop instead of threads.
    Sync and async instances of one ``prefix`` may share the ids.

    With ``start=True`` (the default) the pool starts by itself on ``async
    with`` or at its first transaction (a constructor cannot wait on the
    database); call :meth:`start` to start it earlier, e.g. in a FastAPI
    lifespan.  With ``start=False`` only :meth:`start` starts it, and a
    transaction before raises :class:`~kafka2pc.IllegalStateError`.  Call
    :meth:`close` at shut-down.  ``pipelined=True`` completes each Kafka
    commit in a task of the loop once the database COMMIT is durable, as
    :class:`~kafka2pc.recipes.dual_write.WriterPool` does in a thread (see
    :meth:`transaction` and :meth:`wait_visible`).

    Example::

        pool = AsyncWriterPool(engine, {"bootstrap.servers": "kafka:9092"}, prefix="orders", size=32)
        await pool.start()
        async with AsyncSession(engine) as session, pool.transaction(session) as tx:
            session.add(Order(id=42))
            await tx.produce("orders", key=b"42", value=b"created")
        await pool.close()
    """

    def __init__(
        self,
        engine: AsyncEngine,
        producer_config: Mapping[str, Any],
        *,
        prefix: str,
        size: int,
        max_slots: int | None = None,
        lease_s: float = 15.0,
        scan_every_s: float | None = None,
        acquire_timeout_s: float = 30.0,
        settle_parallelism: int = 8,
        pipelined: bool = False,
        max_in_flight: int | None = None,
        slow_commit_s: float = 1.0,
        state_table: sa.Table | None = None,
        lease_table: sa.Table | None = None,
        owner: str | None = None,
        retain_records: bool = False,
        lock_timeout_s: float | None = None,
        kafka_timeout_s: float | None = None,
        on_step: StepHook | None = None,
        start: bool = True,
        lock_timeout_ms: int | None = None,
    ) -> None:
        """As the class documents; ``lock_timeout_ms`` is the deprecated spelling of ``lock_timeout_s``."""
        lock_timeout_s = seconds_from_ms("AsyncWriterPool", "lock_timeout_ms", lock_timeout_ms,
                                         "lock_timeout_s", lock_timeout_s)
        if not isinstance(engine, AsyncEngine):
            raise UsageError(
                f"AsyncWriterPool takes an AsyncEngine (sqlalchemy.ext.asyncio.create_async_engine), not "
                f"{type(engine).__name__}; use WriterPool with a sync Engine"
            )
        self._engine = engine
        self._sync = _LoopPool(
            engine.sync_engine, producer_config, prefix=prefix, size=size, max_slots=max_slots, lease_s=lease_s,
            scan_every_s=scan_every_s, acquire_timeout_s=acquire_timeout_s, settle_parallelism=settle_parallelism,
            pipelined=pipelined, max_in_flight=max_in_flight, slow_commit_s=slow_commit_s,
            state_table=state_table, lease_table=lease_table, owner=owner, retain_records=retain_records,
            lock_timeout_s=lock_timeout_s, kafka_timeout_s=kafka_timeout_s, on_step=on_step, start=False,
        )
        self._auto_start = start
        self._starting = asyncio.Lock()

    # -- introspection ---------------------------------------------------------------
    @property
    def engine(self) -> AsyncEngine:
        """The database holding the lease and state tables."""
        return self._engine

    @property
    def prefix(self) -> str:
        """The pool's name: its ids are ``<prefix>-0`` .. ``<prefix>-<size-1>``."""
        return self._sync.prefix

    @property
    def owner(self) -> str:
        """This instance's name in the lease table (host, pid and a random part)."""
        return self._sync.owner

    @property
    def transactional_ids(self) -> list[str]:
        """Every id of the pool (all instances)."""
        return self._sync.transactional_ids

    @property
    def held_ids(self) -> list[str]:
        """The ids this instance holds now (its slots)."""
        return self._sync.held_ids

    @property
    def lease_table(self) -> sa.Table:
        """The lease table."""
        return self._sync.lease_table

    @property
    def state_table(self) -> sa.Table:
        """The state table the pool's writers use."""
        return self._sync.state_table

    def metrics(self) -> PoolMetrics:
        """A snapshot of the pool (no I/O), as :meth:`WriterPool.metrics`."""
        return self._sync.metrics()

    async def leases(self) -> list[Lease]:
        """Every lease of the pool as the database has it (one query)."""
        return await in_greenlet(self._sync.leases)

    async def create_tables(self) -> None:
        """Create the state and lease tables if missing: a convenience for scripts and tests."""
        await in_greenlet(self._sync.create_tables)

    # -- life cycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Record the pool's ids (the missing ones), then start renewing leases and settling orphans.

        Idempotent.  The renewal and the orphan scan run as tasks of the
        running loop; the first orphan scan starts at once.
        """
        async with self._starting:
            await run_to_completion(self._sync.start)

    async def close(self, timeout: float | None = None) -> None:
        """Drain the pipelined commits, give the leases back (as :meth:`WriterPool.close`), stop the background tasks.

        Waits up to ``timeout`` seconds (``None``: :data:`~kafka2pc.DEFAULT_CLOSE_TIMEOUT_S`)
        for transactions still running in other tasks and for pipelined commits.
        """
        await run_to_completion(self._sync.close, timeout)

    async def __aenter__(self) -> Self:
        if self._auto_start:
            await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- transactions ----------------------------------------------------------------
    @asynccontextmanager
    async def transaction(
        self, bind: AsyncBind, *, wait_visible: bool = False
    ) -> AsyncIterator[AsyncDualWriteTransaction]:
        """Run one atomic database + Kafka transaction on ``bind`` (an ``AsyncSession`` or ``AsyncConnection``).

        :meth:`WriterPool.transaction` for asyncio, on one of this instance's
        slots: a free slot is taken (leasing and recovering a new id when all
        are busy and fewer than ``max_slots`` exist; waiting, without blocking
        the loop, up to ``acquire_timeout_s`` otherwise, then
        :class:`~kafka2pc.recipes.dual_write.PoolExhaustedError`).  The same
        steps and errors as :meth:`AsyncDualWriter.transaction`; a
        :class:`~kafka2pc.ProducerFencedError` means this instance lost that
        id (the slot is dropped, the next transaction runs on another).
        Starts the pool first if :meth:`start` was not called (``start=True``).

        A pipelined pool returns once the database COMMIT is durable, its
        Kafka commit completing in a task; ``wait_visible=True`` (or
        :meth:`wait_visible`) waits until ``read_committed`` readers see the records.
        """
        target = _sync_target(bind)
        if not self._sync._started and not self._sync._closed:
            if not self._auto_start:
                raise IllegalStateError(f"pool {self.prefix!r} was made with start=False: await start() first")
            await self.start()
        async with run_scope(self._sync.transaction(target, wait_visible=wait_visible)) as handle:
            yield AsyncDualWriteTransaction(handle)

    async def wait_visible(self, timeout: float | None = None) -> None:
        """Wait until every transaction this pool committed so far is visible to ``read_committed`` readers.

        As :meth:`WriterPool.wait_visible`: a no-op unless pipelined; raises
        the error of a background commit that failed, and :class:`TimeoutError`
        after ``timeout`` seconds.
        """
        await in_greenlet(self._sync.wait_visible, timeout)

    # -- orphans -----------------------------------------------------------------------
    async def settle_orphans(self) -> list[RecoveryResult]:
        """Settle now every id whose lease expired; what each recovery found (as :meth:`WriterPool.settle_orphans`).

        The orphan scan runs this every ``scan_every_s`` by itself.
        """
        return await run_to_completion(self._sync.settle_orphans)
