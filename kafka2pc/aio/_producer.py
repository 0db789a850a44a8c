"""``AsyncTwoPhaseCommitProducer``: :class:`kafka2pc.TwoPhaseCommitProducer` for asyncio.

It wraps the sync producer (same state machine, same :class:`PreparedTxnState`,
same errors) and drives it from one dedicated thread per producer
(:class:`~kafka2pc.aio._worker.SerialWorker`), so that no call blocks the
event loop and calls on one producer run in the order they were made.
``docs/asyncio.md`` explains the choice against ``confluent_kafka.aio.AIOProducer``
with the benchmark's figures.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from confluent_kafka import Message

from kafka2pc import (
    IllegalStateError,
    PreparedTxnState,
    QueueFullError,
    Settlement,
    TwoPhaseCommitProducer,
    TxnState,
    UsageError,
)
from kafka2pc._deprecation import renamed, renamed_argument
from kafka2pc._errors import translate_confluent_error  # the one place confluent-kafka errors are mapped
from kafka2pc._fork import ForkGuard
from kafka2pc._producer import DeliveryCallback, Headers
from kafka2pc.aio._worker import SerialWorker

__all__ = ["AsyncTwoPhaseCommitProducer"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_Report = tuple["asyncio.Future[Any]", Any, Any]


class AsyncTwoPhaseCommitProducer:
    """The asyncio counterpart of :class:`kafka2pc.TwoPhaseCommitProducer`.

    Same configuration, same states (:class:`kafka2pc.TxnState`), same
    :class:`kafka2pc.PreparedTxnState` and the same exception classes; every
    method that may wait on the network is a coroutine that runs the sync
    call in this producer's own thread, one call at a time, in order.
    ``await produce(...)`` queues the record (on the loop's thread:
    librdkafka's produce never waits on the network) and returns a future of
    its delivery, which ``prepare_transaction`` waits for anyway;
    ``await produce_and_wait(...)`` also waits for the delivery and returns the
    delivered message (aiokafka's ``send`` and ``send_and_wait``).

    Example (normal path, then recovery in a new process)::

        async with AsyncTwoPhaseCommitProducer({"bootstrap.servers": "localhost:9092",
                                                "transactional.id": "orders-1"}) as p:
            await p.init_transactions()
            await p.begin_transaction()
            await p.produce("orders", key=b"42", value=b"created")
            state = await p.prepare_transaction()
            await db.store(str(state)); await db.commit()   # the decision point
            await p.commit_transaction()

        # after a crash, in a new process:
        p = AsyncTwoPhaseCommitProducer(same_config)
        await p.init_transactions(keep_prepared_txn=True)
        await p.complete_transaction(PreparedTxnState(await db.load()))

    **Cancellation.** Cancelling a task that awaits a call never interrupts
    the call: it runs to completion in the producer's thread (a queued call
    still runs), and the producer's ``state`` reflects its outcome, exactly
    as if the task had waited.  The next call is queued behind it and so
    starts from that state; :meth:`wait_idle` waits for it and returns the
    state.  While a transaction-control call (begin, prepare, commit, abort,
    complete, init, send offsets) is queued or running, ``produce`` raises
    :class:`kafka2pc.IllegalStateError` rather than slipping a record into
    a transaction that is being prepared or ended.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        delivery_poll_interval_s: float = 0.005,
        queue_full_timeout_s: float = 30.0,
        delivery_poll_interval: float | None = None,
        queue_full_timeout: float | None = None,
    ) -> None:
        """``config`` as for :class:`kafka2pc.TwoPhaseCommitProducer`.

        ``delivery_poll_interval_s``: how often the producer's thread serves
        delivery reports while records are in flight.  ``queue_full_timeout_s``:
        how long :meth:`produce` waits for room in librdkafka's full local
        queue before it raises :class:`kafka2pc.QueueFullError`.
        ``delivery_poll_interval`` and ``queue_full_timeout`` are their
        deprecated 0.1 names.
        """
        where = "AsyncTwoPhaseCommitProducer"
        delivery_poll_interval_s = renamed_argument(where, "delivery_poll_interval", delivery_poll_interval,
                                                    "delivery_poll_interval_s", delivery_poll_interval_s)
        queue_full_timeout_s = renamed_argument(where, "queue_full_timeout", queue_full_timeout,
                                                "queue_full_timeout_s", queue_full_timeout_s)
        if delivery_poll_interval_s <= 0:
            raise UsageError("delivery_poll_interval_s must be positive")
        if queue_full_timeout_s < 0:
            raise UsageError("queue_full_timeout_s must not be negative")
        self._sync = TwoPhaseCommitProducer(config)
        self._fork_guard = ForkGuard(f"AsyncTwoPhaseCommitProducer({self._sync.transactional_id!r})")
        self._queue_full_timeout = queue_full_timeout_s
        self._reports: list[_Report] = []
        self._pending: set[asyncio.Future[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._control_in_flight: list[str] = []
        self._closed = False
        self._worker = SerialWorker(
            f"kafka2pc-aio-{self._sync.transactional_id}",
            idle=self._has_undelivered,
            serve=self._serve_reports,
            after_call=self._take_reports,
            idle_interval=delivery_poll_interval_s,
        )

    # -- introspection ---------------------------------------------------------
    @property
    def transactional_id(self) -> str:
        """The ``transactional.id`` this producer owns."""
        return self._sync.transactional_id

    @property
    def state(self) -> TxnState:
        """The transaction state, as of the last call that finished (see :class:`kafka2pc.TxnState`)."""
        return self._sync.state

    @property
    def prepared_state(self) -> PreparedTxnState | None:
        """The state returned by the last ``prepare_transaction`` while it is prepared or in doubt."""
        return self._sync.prepared_state

    @property
    def last_settlement(self) -> Settlement | None:
        """What the last recovery-path completion decided and observed."""
        return self._sync.last_settlement

    @property
    def in_flight(self) -> tuple[str, ...]:
        """Names of the transaction-control calls queued or running, oldest first."""
        return tuple(self._control_in_flight)

    @property
    def sync_producer(self) -> TwoPhaseCommitProducer:
        """The wrapped sync producer (read its properties; call it only from its own thread)."""
        return self._sync

    def __len__(self) -> int:
        return len(self._sync)

    # -- life cycle -------------------------------------------------------------
    async def init_transactions(self, timeout: float | None = None, *, keep_prepared_txn: bool = False) -> None:
        """Register the transactional id; see :meth:`kafka2pc.TwoPhaseCommitProducer.init_transactions`."""
        await self._control(
            "init_transactions",
            functools.partial(self._sync.init_transactions, timeout, keep_prepared_txn=keep_prepared_txn),
        )

    async def begin_transaction(self) -> None:
        """Start a transaction (no broker round trip, but ordered behind any queued call)."""
        await self._control("begin_transaction", self._sync.begin_transaction)

    async def produce(
        self,
        topic: str,
        value: bytes | str | None = None,
        key: bytes | str | None = None,
        partition: int | None = None,
        on_delivery: DeliveryCallback | None = None,
        timestamp: int | None = None,
        headers: Headers | None = None,
    ) -> asyncio.Future[Message]:
        """Queue a record within the transaction; return a future of its delivery.

        Awaiting ``produce`` means the record is queued: handed to librdkafka
        on the loop's thread, which never waits on the network.  That is all
        a two-phase transaction needs, since ``prepare_transaction`` waits for
        every record and reports any failed delivery.  The returned future
        resolves to the delivered ``confluent_kafka.Message`` or raises the
        kafka2pc error of a failed delivery; awaiting it is optional (or use
        :meth:`produce_and_wait`).  When librdkafka's local queue is full,
        waits (without blocking the loop) up to ``queue_full_timeout_s``
        seconds for room, then raises :class:`kafka2pc.QueueFullError`.
        The parameters are :meth:`kafka2pc.TwoPhaseCommitProducer.produce`'s;
        ``on_delivery(error, message)`` runs on the loop once the record is
        delivered or failed (``error``: the kafka2pc error, or ``None``).

        Example::

            await producer.produce("orders", value=b"created", key=b"42")
        """
        loop = self._bind_loop()
        if self._control_in_flight:
            raise IllegalStateError(
                f"produce() refused: {self._control_in_flight[0]}() is still running "
                "(a caller stopped waiting for it); await wait_idle() first"
            )
        future: asyncio.Future[Message] = loop.create_future()
        if on_delivery is not None:
            future.add_done_callback(functools.partial(_report, on_delivery))
        kwargs: dict[str, Any] = {"value": value, "key": key,
                                  "on_delivery": functools.partial(self._on_delivery, future)}
        if partition == -1 or timestamp == 0:
            renamed("produce(partition=-1, timestamp=0)", "partition=None, timestamp=None (the defaults)")
        if partition is not None and partition != -1:
            kwargs["partition"] = partition
        if timestamp is not None and timestamp != 0:
            kwargs["timestamp"] = timestamp
        if headers is not None:
            kwargs["headers"] = headers
        deadline: float | None = None
        pause = 0.001
        while True:
            try:
                self._sync.produce(topic, **kwargs)
                break
            except QueueFullError:
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self._queue_full_timeout
                if now >= deadline:
                    raise
                await asyncio.sleep(min(pause, deadline - now))
                pause = min(pause * 2, 0.05)
                if self._control_in_flight:
                    raise IllegalStateError(
                        f"produce() refused: {self._control_in_flight[0]}() started while it waited for room"
                    ) from None
        self._pending.add(future)
        self._worker.wake()
        return future

    async def produce_and_wait(
        self,
        topic: str,
        value: bytes | str | None = None,
        key: bytes | str | None = None,
        partition: int | None = None,
        on_delivery: DeliveryCallback | None = None,
        timestamp: int | None = None,
        headers: Headers | None = None,
    ) -> Message:
        """Queue a record and wait for its delivery (:meth:`produce`, then await its future).

        Returns the delivered ``confluent_kafka.Message`` (its partition and
        offset are known); a failed delivery raises its kafka2pc error.

        Example::

            message = await producer.produce_and_wait("orders", value=b"created", key=b"42")
        """
        delivery = await self.produce(
            topic, value, key, partition=partition, on_delivery=on_delivery, timestamp=timestamp, headers=headers
        )
        return await delivery

    async def produce_batch(
        self,
        topic: str,
        values: Sequence[str | bytes | None],
        keys: Sequence[str | bytes | None] | None = None,
        *,
        partition: int | None = None,
        timeout: float | None = None,
    ) -> int:
        """Send ``len(values)`` records to ``topic`` within the transaction, in order; return how many.

        :meth:`kafka2pc.TwoPhaseCommitProducer.produce_batch`, in the
        producer's thread (the loop runs on while a full local queue is
        waited out, up to ``timeout`` seconds).  Delivery reports anchor the
        prepared state as for :meth:`produce`; no per-record future.
        """
        self._bind_loop()
        if self._control_in_flight:
            raise IllegalStateError(
                f"produce_batch() refused: {self._control_in_flight[0]}() is still running; await wait_idle() first"
            )
        return await self._call(functools.partial(
            self._sync.produce_batch, topic, values, keys, partition=partition, timeout=timeout))

    async def poll(self, timeout: float = 0) -> int:
        """Serve delivery reports, waiting up to ``timeout`` seconds for one; return how many were served.

        The producer's thread serves them by itself while records are in
        flight: call this only to wait for deliveries explicitly.
        """
        return await self._call(functools.partial(self._sync.poll, timeout))

    async def flush(self, timeout: float | None = None) -> int:
        """Wait for outstanding records, up to ``timeout`` seconds; return how many remain.

        As :meth:`kafka2pc.TwoPhaseCommitProducer.flush` (``None``:
        :data:`~kafka2pc.DEFAULT_TIMEOUT_S`), in the producer's thread.
        """
        if timeout is not None and timeout < 0:
            renamed("flush(timeout=-1)", "flush(timeout=<seconds>) (None: DEFAULT_TIMEOUT_S)")
            return await self._call(self._flush_unbounded)
        return await self._call(functools.partial(self._sync.flush, timeout))

    async def send_offsets_to_transaction(
        self, offsets: list[Any], group_metadata: Any, timeout: float | None = None
    ) -> None:
        """Add consumer offsets to the transaction (exactly-once consume-transform-produce)."""
        await self._control(
            "send_offsets_to_transaction",
            functools.partial(self._sync.send_offsets_to_transaction, offsets, group_metadata, timeout),
        )

    async def prepare_transaction(self, timeout: float | None = None) -> PreparedTxnState:
        """Flush the transaction and return its state; see :meth:`kafka2pc.TwoPhaseCommitProducer.prepare_transaction`.

        Example::

            state = await producer.prepare_transaction()
            await session.execute(save_state, {"state": str(state)})
        """
        return await self._control("prepare_transaction", functools.partial(self._sync.prepare_transaction, timeout))

    async def commit_transaction(self, timeout: float | None = None) -> None:
        """Commit; a timeout raises :class:`kafka2pc.IndefiniteOutcomeError` (retry or complete)."""
        await self._control("commit_transaction", functools.partial(self._sync.commit_transaction, timeout))

    async def abort_transaction(self, timeout: float | None = None) -> None:
        """Abort the current transaction (or, when recovering, the one left open)."""
        await self._control("abort_transaction", functools.partial(self._sync.abort_transaction, timeout))

    async def complete_transaction(self, state: PreparedTxnState, timeout: float | None = None) -> None:
        """Commit if ``state`` names the prepared transaction, else abort it (KIP-939).

        See :meth:`kafka2pc.TwoPhaseCommitProducer.complete_transaction`.

        Example (recovery at start-up)::

            await producer.init_transactions(keep_prepared_txn=True)
            await producer.complete_transaction(PreparedTxnState(stored_text))
        """
        if not isinstance(state, PreparedTxnState):
            raise UsageError(f"complete_transaction() takes a PreparedTxnState, not {type(state).__name__}")
        await self._control(
            "complete_transaction", functools.partial(self._sync.complete_transaction, state, timeout)
        )

    async def wait_idle(self) -> TxnState:
        """Wait until every call made so far has finished (cancelled ones included); return the state."""
        await self._call(lambda: None)
        return self._sync.state

    async def close(self, timeout: float | None = None) -> None:
        """Release the producer, its control plane and its thread (after the calls already queued).

        ``timeout`` as for :meth:`kafka2pc.TwoPhaseCommitProducer.close`
        (``None``: :data:`~kafka2pc.DEFAULT_CLOSE_TIMEOUT_S`).  In a child
        forked after the producer was made it returns at once and sends
        nothing, as the sync ``close`` does there (the producer's thread lives
        only in the parent).
        """
        if self._closed:
            return
        try:
            if self._fork_guard.forked:
                self._sync.close(timeout)  # in the child: sends nothing, returns at once
            else:
                await self._call(functools.partial(self._sync.close, timeout))
        finally:
            self._closed = True
            self._worker.stop()
            for future in self._pending:
                if not future.done():
                    future.set_exception(IllegalStateError("the producer was closed before the record was delivered"))
            self._pending.clear()

    async def __aenter__(self) -> AsyncTwoPhaseCommitProducer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- internals ----------------------------------------------------------------
    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        self._fork_guard.check()  # in a forked child the producer's thread is gone: a call would never return
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise UsageError("an AsyncTwoPhaseCommitProducer is bound to the event loop that first used it")
        if self._closed:
            raise IllegalStateError("the producer is closed")
        return loop

    def _call(self, fn: Callable[[], _T]) -> asyncio.Future[_T]:
        loop = self._bind_loop()
        return self._worker.submit(loop, fn, _nothing)

    async def _control(self, name: str, fn: Callable[[], _T]) -> _T:
        loop = self._bind_loop()

        def done() -> None:  # on the loop, once the call has finished
            self._control_in_flight.remove(name)

        future = self._worker.submit(loop, fn, done)
        self._control_in_flight.append(name)
        return await future

    def _flush_unbounded(self) -> int:
        """The deprecated ``flush(-1)``: wait, without a bound, until nothing is outstanding (its warning given)."""
        while (remaining := self._sync.flush(None)) > 0:
            pass
        return remaining

    def _has_undelivered(self) -> bool:
        return len(self._sync) > 0

    def _serve_reports(self) -> None:
        if self._sync.state not in (TxnState.FATAL_ERROR, TxnState.CLOSED):
            self._sync.poll(0)
        self._hand_over_reports()

    def _on_delivery(self, future: asyncio.Future[Any], err: Any, msg: Any) -> None:
        # Runs in the worker thread (librdkafka serves reports in poll/flush there).
        self._reports.append((future, err, msg))

    def _take_reports(self) -> Callable[[], None] | None:
        """In the worker, after a call: the delivery reports it served, as a function for the loop."""
        if not self._reports:
            return None
        batch, self._reports = self._reports, []
        return functools.partial(self._resolve_reports, batch)

    def _hand_over_reports(self) -> None:
        resolve = self._take_reports()
        if resolve is None or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(resolve)
        except RuntimeError:
            logger.debug("%s: loop closed; delivery reports dropped", self.transactional_id)

    def _resolve_reports(self, batch: list[_Report]) -> None:
        for future, err, msg in batch:
            self._pending.discard(future)
            if future.done():
                continue
            if err is None:
                future.set_result(msg)
            else:
                future.set_exception(
                    translate_confluent_error(err, f"delivery of a record of {self.transactional_id!r}")
                )
                # prepare_transaction reports the failure too: an un-awaited delivery
                # future must not log "exception was never retrieved" (awaiting it still raises).
                future.exception()


def _nothing() -> None:
    pass


def _report(on_delivery: DeliveryCallback, future: asyncio.Future[Message]) -> None:
    """On the loop, once a record's delivery future is done: its ``on_delivery(error, message)``."""
    if future.cancelled():
        return
    error = future.exception()
    on_delivery(error, None if error is not None else future.result())  # type: ignore[arg-type]

