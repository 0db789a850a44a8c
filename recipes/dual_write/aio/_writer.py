"""``AsyncDualWriter``: the dual-write recipe for asyncio services (SQLAlchemy's asyncio extension)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from kafka2pc import ForkedProcessError, IllegalStateError, OnHeuristic, PreparedTxnState, UsageError
from kafka2pc._deprecation import deprecated_property, seconds_from_ms
from kafka2pc.aio import AsyncTwoPhaseCommitProducer

from .._async_handle import AsyncHandleCalls, Headers
from .._events import EVENTS, StepListener
from .._handle import DualWriteTransaction
from .._lifecycle import WriterState
from .._options import DEFAULT_QUEUE_FULL_TIMEOUT_S, DEFAULT_SETTLE_ATTEMPTS, WriterOptions, options_from
from .._runtime import forks_seen
from .._schema import create_state_table
from .._values import DualWriteMetrics, RecoveryResult, StepHook, heuristic_flags
from .._writer import writer_on
from ._bridge import ScopeRun, _GreenletProducer, in_greenlet, run_to_completion
from ._runtime import EVENT_LOOP

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AsyncBind", "AsyncDualWriteTransaction", "AsyncDualWriter", "recover_all", "run_scope"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

AsyncBind = AsyncSession | AsyncConnection
"""What :meth:`AsyncDualWriter.transaction` runs on: an ``AsyncSession`` or an ``AsyncConnection``."""


class AsyncDualWriteTransaction:
    """The handle :meth:`AsyncDualWriter.transaction` yields: produce records, add consumer offsets.

    Rows are written with the ``AsyncSession`` or ``AsyncConnection`` the
    transaction was opened on; they commit together with the records
    produced here.  Each call runs the sync handle's call on the loop's
    greenlet bridge.
    """

    def __init__(self, handle: DualWriteTransaction) -> None:
        self._calls = AsyncHandleCalls(handle, in_greenlet)

    @property
    def transactional_id(self) -> str:
        """The Kafka transactional id this transaction runs under."""
        return self._calls.handle.transactional_id

    @property
    def prepared_state(self) -> PreparedTxnState | None:
        """The state stored in the database once the transaction is prepared."""
        return self._calls.handle.prepared_state

    @property
    def records_produced(self) -> int:
        """How many records this transaction produced so far."""
        return self._calls.handle.records_produced

    @property
    def connection(self) -> AsyncConnection:
        """The database connection of this transaction (the ``AsyncConnection`` over the sync one)."""
        return AsyncConnection._retrieve_proxy_for_target(self._calls.handle.connection)

    async def produce(
        self,
        topic: str,
        value: str | bytes | None = None,
        key: str | bytes | None = None,
        partition: int | None = None,
        on_delivery: Callable[[Any, Any], None] | None = None,
        timestamp: int | None = None,
        headers: Headers | None = None,
    ) -> None:
        """Produce one record in the transaction (arguments as :meth:`DualWriteTransaction.produce`).

        Returns once librdkafka has the record (an enqueue; the prepare
        waits for its delivery).  ``error`` in ``on_delivery(error, message)``
        is the kafka2pc error of a failed delivery.  A full local queue is
        waited out for up to the writer's ``queue_full_timeout_s``; the first
        record of a topic the writer has not seen yet waits for one metadata
        request.  These waits do not block the loop, and ``on_delivery`` runs
        on the loop.
        """
        await self._calls.produce(topic, value, key, partition, on_delivery, timestamp, headers)

    async def send_offsets_to_transaction(self, offsets: list[Any], group_metadata: Any) -> None:
        """Commit consumer offsets with this transaction (exactly-once consume-transform-produce)."""
        await self._calls.send_offsets_to_transaction(offsets, group_metadata)

    async def send_consumer_offsets(self, consumer: Any) -> None:
        """Commit the current positions of ``consumer``'s assignment (a ``confluent_kafka.Consumer``)."""
        await self._calls.send_consumer_offsets(consumer)


class AsyncDualWriter:
    """Atomic writes to a SQL database and Kafka for asyncio services (KIP-939's dual-write recipe).

    The asyncio counterpart of :class:`~kafka2pc.recipes.dual_write.DualWriter`,
    on SQLAlchemy's asyncio extension: ``engine`` is an ``AsyncEngine``
    (PostgreSQL through ``postgresql+psycopg://``, SQLite through
    ``sqlite+aiosqlite://``), transactions run on an ``AsyncSession`` or an
    ``AsyncConnection``.  The arguments, the steps (``on_step``, a sync
    callable), the state and outbox tables, the recovery, the misuse guards,
    the errors and the metrics are those of the sync writer: it is the sync
    writer's code, run on the event loop, with its Kafka producer an
    :class:`~kafka2pc.aio.AsyncTwoPhaseCommitProducer` (one thread of its
    own).  No call waits on the loop's thread: database calls are the async
    driver's, Kafka calls the producer thread's.

    Example (a FastAPI service; ``examples/fastapi_orders.py`` is the whole of it)::

        writer = AsyncDualWriter(engine, {"bootstrap.servers": "kafka:9092",
                                          "transactional.id": "orders-1"})

        @asynccontextmanager
        async def lifespan(app):
            await writer.recover()          # settle what the previous instance left
            yield
            await writer.close()

        @app.post("/orders")
        async def create_order(order: Order):
            async with AsyncSession(engine) as session:
                async with writer.transaction(session) as tx:
                    session.add(OrderRow(id=order.id))
                    await tx.produce("orders", key=order.id, value=order.json())

    Transactions of one writer run one at a time (tasks queue up for it);
    run several writers, each with its own ``transactional.id``, to run
    transactions in parallel.  Cancelling a task while the writer commits,
    rolls back or recovers does not interrupt that step: it ends first, then
    the task sees :class:`asyncio.CancelledError`.
    """

    def __init__(
        self,
        engine: AsyncEngine,
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
        """As :class:`DualWriter`; ``lock_timeout_ms`` is the deprecated spelling of ``lock_timeout_s``;
        ``options`` gives the settings as one value (instead of the keywords)."""
        lock_timeout_s = seconds_from_ms("AsyncDualWriter", "lock_timeout_ms", lock_timeout_ms,
                                         "lock_timeout_s", lock_timeout_s)
        if not isinstance(engine, AsyncEngine):
            raise UsageError(
                f"AsyncDualWriter takes an AsyncEngine (sqlalchemy.ext.asyncio.create_async_engine), not "
                f"{type(engine).__name__}; use DualWriter with a sync Engine"
            )
        options = options_from(options, retain_records=retain_records, lock_timeout_s=lock_timeout_s,
                               on_step=on_step, settle_attempts=settle_attempts,
                               queue_full_timeout_s=queue_full_timeout_s, kafka_timeout_s=kafka_timeout_s)
        self._engine = engine
        self._sync, _ = writer_on(EVENT_LOOP, engine.sync_engine, producer_config, options,
                               state_table=state_table, outbox_table=outbox_table)
        self._lock = asyncio.Lock()
        self._holder: asyncio.Task[Any] | None = None
        self._pid = os.getpid()
        self._forks = forks_seen()

    # -- introspection -------------------------------------------------------------
    @property
    def transactional_id(self) -> str:
        """The Kafka transactional id (and the state row's key)."""
        return self._sync.transactional_id

    @property
    def engine(self) -> AsyncEngine:
        """The database holding the state table."""
        return self._engine

    @property
    def state_table(self) -> sa.Table:
        """The state table this writer locks and updates."""
        return self._sync.state_table

    @property
    def outbox_table(self) -> sa.Table | None:
        """The outbox table (``None`` unless configured or ``retain_records=True``)."""
        return self._sync.outbox_table

    @property
    def retain_records(self) -> bool:
        """Whether records are kept in the outbox until Kafka commits them."""
        return self._sync.retain_records

    @property
    def producer(self) -> AsyncTwoPhaseCommitProducer | None:
        """The current producer (``None`` before the first recovery)."""
        bridge = cast("_GreenletProducer | None", self._sync.producer)
        return None if bridge is None else bridge.async_producer

    @property
    def fenced(self) -> bool:
        """True once another instance took over this transactional id; only :meth:`recover` resets it."""
        return self._sync.fenced

    @property
    def state(self) -> WriterState:
        """Where the writer is in its life cycle (as :attr:`kafka2pc.aio.AsyncTwoPhaseCommitProducer.state`)."""
        return self._sync.state

    status = deprecated_property("status", "state", lambda self: self._sync.state)

    def metrics(self) -> DualWriteMetrics:
        """A snapshot of this writer's gauges and counters (no I/O)."""
        return self._sync.metrics()

    @property
    def options(self) -> WriterOptions:
        """How this writer runs (its constructor's options as one value)."""
        return self._sync.options

    events: ClassVar[frozenset[str]] = EVENTS
    """The events listeners may attach to (see :meth:`add_listener`)."""

    def add_listener(self, event: str, fn: StepListener) -> None:
        """Call ``fn(writer, step)`` at every :class:`Step` (``event="step"``), as :meth:`DualWriter.add_listener`.

        ``writer`` is the :class:`DualWriter` running this writer's code on
        the loop; listeners run on the loop's thread, so they must not block.
        """
        self._sync.add_listener(event, fn)

    def remove_listener(self, event: str, fn: StepListener) -> None:
        """Detach a listener :meth:`add_listener` attached (:class:`~kafka2pc.UsageError` if it was not)."""
        self._sync.remove_listener(event, fn)

    async def create_tables(self) -> None:
        """Create the state (and outbox) table if missing: a convenience for scripts and tests."""
        tables = [self.state_table] + ([self.outbox_table] if self.outbox_table is not None else [])

        def create(conn: sa.Connection) -> None:
            for table in tables:
                if table is self.state_table:
                    create_state_table(conn, table)
                else:
                    table.create(conn, checkfirst=True)

        async with self._engine.begin() as conn:
            await conn.run_sync(create)

    # -- life cycle ------------------------------------------------------------------
    async def recover(
        self,
        *,
        on_heuristic: OnHeuristic = "raise",
        raise_on_heuristic: bool | None = None,
        acknowledge_heuristic: bool | None = None,
    ) -> RecoveryResult:
        """Settle whatever the previous owner of this transactional id left, then accept new work.

        :meth:`DualWriter.recover`, without blocking the loop: claims the
        state row (committed before Kafka is touched), completes the prepared
        Kafka transaction with a new producer (commit iff the database holds
        its state), then finishes under the claim.  Run it at start-up, before
        the service takes requests (a FastAPI lifespan).  Same arguments,
        result and errors (``raise_on_heuristic`` and ``acknowledge_heuristic``
        are the deprecated 0.1 flags).
        """
        raise_, acknowledge = heuristic_flags("AsyncDualWriter.recover", on_heuristic,
                                              raise_on_heuristic, acknowledge_heuristic)
        on_heuristic = "acknowledge" if acknowledge else "raise" if raise_ else "report"
        async with self._exclusive():
            return await run_to_completion(self._sync.recover, on_heuristic=on_heuristic)

    @asynccontextmanager
    async def transaction(self, bind: AsyncBind) -> AsyncIterator[AsyncDualWriteTransaction]:
        """Run one atomic database + Kafka transaction on ``bind`` (an ``AsyncSession`` or ``AsyncConnection``).

        :meth:`DualWriter.transaction` for asyncio: the database transaction is
        begun here (or the one ``bind`` already has is adopted) and committed
        on a normal exit of the block, together with the Kafka transaction; an
        exception in the block rolls back both sides and propagates.  The
        same errors: :class:`~kafka2pc.ProducerFencedError`,
        :class:`TransactionMisuseError` (the block committed, rolled back or
        closed the bound transaction), :class:`~kafka2pc.IndefiniteOutcomeError`.

        Example::

            async with AsyncSession(engine) as session:
                async with writer.transaction(session) as tx:
                    session.add(Order(id=42))
                    await tx.produce("orders", key=b"42", value=b"created")
        """
        target = _sync_target(bind)
        async with self._exclusive(), run_scope(self._sync.transaction(target)) as handle:
            yield AsyncDualWriteTransaction(handle)

    async def close(self, timeout: float | None = None) -> None:
        """Release the producer (and its thread).  A prepared transaction is left for the next :meth:`recover`.

        ``timeout`` as for :meth:`DualWriter.close`.
        """
        await in_greenlet(self._sync.close, timeout)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        if self._forks != forks_seen():  # before the lock: it belongs to the parent's loop
            raise ForkedProcessError(
                f"{self.transactional_id!r}: this AsyncDualWriter was made in process {self._pid} and is used in "
                f"its forked child {os.getpid()}: make it in the child (gunicorn's post_worker_init, uvicorn's "
                "lifespan), or use an AsyncWriterPool, which remakes itself in the child", pid=self._pid,
            )
        task = asyncio.current_task()
        if task is not None and task is self._holder:
            raise IllegalStateError(f"{self.transactional_id!r}: transaction() and recover() cannot be nested")
        async with self._lock:
            self._holder = task
            try:
                yield
            finally:
                self._holder = None


def run_scope(scope: AbstractContextManager[DualWriteTransaction]) -> AbstractAsyncContextManager[DualWriteTransaction]:
    """The sync recipe's transaction scope (a writer's or a pool's), entered and exited in the greenlet bridge.

    One task of its own enters and leaves it (:class:`ScopeRun`), so that
    entering and exiting run to completion whatever happens to the caller's
    task (see :func:`run_to_completion`); an exception of the block goes to
    the scope, which rolls back both sides and re-raises it.  A caller
    cancelled while the scope was being entered (waiting for a pool's slot,
    say) gets its :class:`asyncio.CancelledError` once the entry ended, after
    the scope was left the same way: nothing entered stays held.
    """
    return ScopeRun(scope)


def _sync_target(bind: AsyncBind) -> Session | sa.Connection:
    if isinstance(bind, AsyncSession):
        return bind.sync_session
    if isinstance(bind, AsyncConnection):
        if bind.sync_connection is None:
            raise UsageError("the AsyncConnection is not started: use `async with engine.connect() as conn`")
        return bind.sync_connection
    raise UsageError(
        f"transaction() takes an AsyncSession or an AsyncConnection, not {type(bind).__name__}"
    )


async def recover_all(writers: Iterable[AsyncDualWriter]) -> dict[str, RecoveryResult]:
    """Recover many writers (one per instance or shard) concurrently; never raises.

    :func:`~kafka2pc.recipes.dual_write.recover_all` for asyncio: one
    :class:`RecoveryResult` per transactional id, a heuristic outcome in
    ``result.heuristic``, any other failure in ``result.error``.
    """

    async def one(writer: AsyncDualWriter) -> RecoveryResult:
        try:
            return await writer.recover(on_heuristic="report")
        except Exception as exc:  # noqa: BLE001 - reported per id
            logger.error("recovery of %r failed: %s", writer.transactional_id, exc)
            return RecoveryResult(writer.transactional_id, PreparedTxnState(), None, error=exc)

    results = await asyncio.gather(*(one(w) for w in writers))
    return {r.transactional_id: r for r in results}
