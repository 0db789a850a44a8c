"""``AsyncWriterPool``: the writer pool for asyncio services (SQLAlchemy's asyncio extension).

The sync pool's code (:class:`~kafka2pc.recipes.dual_write.WriterPool`: leases,
fencing epochs, slot reuse, renewal, the orphan scan and its settling, the
pipelined commit) runs unchanged on the event loop, in SQLAlchemy's greenlet
bridge as :class:`AsyncDualWriter` runs the sync writer's (see ``_bridge.py``),
made with the loop's runtime (``_runtime.py``'s ``EventLoop``): that object is
the whole of the difference.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from kafka2pc import IllegalStateError, UsageError
from kafka2pc._deprecation import seconds_from_ms

from .._events import EVENTS, StepListener
from .._lease import Lease
from .._lifecycle import PoolState
from .._options import (
    DEFAULT_ACQUIRE_TIMEOUT_S,
    DEFAULT_LEASE_S,
    DEFAULT_SETTLE_PARALLELISM,
    DEFAULT_SLOW_COMMIT_S,
    WriterOptions,
    options_from,
)
from .._pool import PoolMetrics, PoolShape, pool_on
from .._runtime import forks_seen
from .._values import RecoveryResult, StepHook
from ._bridge import in_greenlet, run_to_completion
from ._runtime import EVENT_LOOP
from ._writer import AsyncBind, AsyncDualWriteTransaction, _sync_target, run_scope

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AsyncWriterPool"]

logger = logging.getLogger(__name__)


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
        lease_s: float = DEFAULT_LEASE_S,
        scan_every_s: float | None = None,
        acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S,
        settle_parallelism: int = DEFAULT_SETTLE_PARALLELISM,
        pipelined: bool = False,
        max_in_flight: int | None = None,
        slow_commit_s: float = DEFAULT_SLOW_COMMIT_S,
        state_table: sa.Table | None = None,
        lease_table: sa.Table | None = None,
        owner: str | None = None,
        retain_records: bool = False,
        lock_timeout_s: float | None = None,
        kafka_timeout_s: float | None = None,
        on_step: StepHook | None = None,
        start: bool = True,
        lock_timeout_ms: int | None = None,
        options: WriterOptions | None = None,
    ) -> None:
        """As the class documents; ``lock_timeout_ms`` is the deprecated spelling of ``lock_timeout_s``;
        ``options`` gives the writers' settings as one value (instead of their keywords)."""
        lock_timeout_s = seconds_from_ms("AsyncWriterPool", "lock_timeout_ms", lock_timeout_ms,
                                         "lock_timeout_s", lock_timeout_s)
        if not isinstance(engine, AsyncEngine):
            raise UsageError(
                f"AsyncWriterPool takes an AsyncEngine (sqlalchemy.ext.asyncio.create_async_engine), not "
                f"{type(engine).__name__}; use WriterPool with a sync Engine"
            )
        options = options_from(options, retain_records=retain_records, lock_timeout_s=lock_timeout_s,
                               kafka_timeout_s=kafka_timeout_s, on_step=on_step)
        self._engine = engine
        self._sync = pool_on(
            EVENT_LOOP, engine.sync_engine, producer_config,
            PoolShape(prefix, size, max_slots, lease_s, scan_every_s, acquire_timeout_s, settle_parallelism,
                      pipelined, max_in_flight, slow_commit_s, owner),
            options, state_table=state_table, lease_table=lease_table,
        )
        self._auto_start = start
        self._starting = asyncio.Lock()
        self._forks = forks_seen()

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

    @property
    def state(self) -> PoolState:
        """Where the pool is in its life cycle: new, starting, running or closed."""
        return self._sync.state

    @property
    def options(self) -> WriterOptions:
        """How the pool's writers run (``lock_timeout_s`` filled in with the pool's default)."""
        return self._sync.options

    def metrics(self) -> PoolMetrics:
        """A snapshot of the pool (no I/O), as :meth:`WriterPool.metrics`."""
        return self._sync.metrics()

    events: ClassVar[frozenset[str]] = EVENTS
    """The events listeners may attach to (see :meth:`add_listener`)."""

    def add_listener(self, event: str, fn: StepListener) -> None:
        """Call ``fn(writer, step)`` at every :class:`Step` any writer of this pool reaches (``event="step"``).

        As :meth:`WriterPool.add_listener`; listeners run on the loop's
        thread, so they must not block.
        """
        self._sync.add_listener(event, fn)

    def remove_listener(self, event: str, fn: StepListener) -> None:
        """Detach a listener :meth:`add_listener` attached (:class:`~kafka2pc.UsageError` if it was not)."""
        self._sync.remove_listener(event, fn)

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
        async with self._start_lock():
            await run_to_completion(self._sync.start)

    def _start_lock(self) -> asyncio.Lock:
        """The lock serialising :meth:`start` (a new one in a forked child: the parent's belongs to its loop)."""
        if self._forks != forks_seen():
            self._starting, self._forks = asyncio.Lock(), forks_seen()
        return self._starting

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
        if self._sync.state is PoolState.NEW:
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
