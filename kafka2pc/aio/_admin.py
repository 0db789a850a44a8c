"""``AsyncTransactionAdmin``: :class:`kafka2pc.TransactionAdmin` for asyncio.

The control plane (kafka-python requests to coordinators and partition
leaders) runs in one dedicated thread per admin, in call order, so a
coordinator that does not answer delays the awaiting task, never the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping
from typing import Any, TypeVar

from kafka2pc import (
    Decision,
    IllegalStateError,
    KafkaTransactionError,
    OnHeuristic,
    OpenTransaction,
    PartitionLag,
    PreparedTxnState,
    ProducerState,
    RecoveryPlan,
    Settlement,
    TopicAndPartition,
    TransactionAdmin,
    TransactionDescription,
    TransactionInfo,
    TransactionOutcome,
)
from kafka2pc._admin import on_heuristic_raises
from kafka2pc._control import ControlPlane
from kafka2pc._deprecation import deprecated_alias, seconds_from_ms
from kafka2pc._fork import ForkGuard
from kafka2pc._recovery import outcome_of
from kafka2pc.aio._worker import SerialWorker

__all__ = ["AsyncTransactionAdmin"]

_T = TypeVar("_T")

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("kafka2pc_aio_admin_deadline", default=None)
"""The ``time.monotonic()`` deadline an :meth:`AsyncTransactionAdmin.bounded` block set for this task."""


class AsyncTransactionAdmin:
    """Inspect, settle and terminate transactions from an event loop (no producer needed).

    Each method is the coroutine counterpart of the
    :class:`kafka2pc.TransactionAdmin` method of the same name, with the same
    arguments, results and errors.  Cancelling an awaiting task does not
    interrupt the request: it completes in the admin's thread.

    Example (recovery at start-up, e.g. from a FastAPI lifespan)::

        async with AsyncTransactionAdmin({"bootstrap.servers": "localhost:9092"}) as admin:
            settlement = await admin.complete_transaction("orders-1", PreparedTxnState(stored_text))
            for info in await admin.list_transactions(min_open_s=60):
                logger.warning("%s open for %.0f s", info.transactional_id, info.open_for_s)
    """

    def __init__(
        self, config: Mapping[str, Any], *, timeout_s: float | None = None, request_timeout_s: float | None = None
    ) -> None:
        """``config``, ``timeout_s`` and ``request_timeout_s`` as for :class:`kafka2pc.TransactionAdmin`.

        ``timeout_s`` bounds each method call given no ``timeout`` (default
        30 s); ``request_timeout_s`` each request on the wire.
        """
        self._fork_guard = ForkGuard("AsyncTransactionAdmin")
        self._sync = TransactionAdmin(config, timeout_s=timeout_s, request_timeout_s=request_timeout_s)
        self._worker = SerialWorker("kafka2pc-aio-admin")
        self._closed = False

    @property
    def sync_admin(self) -> TransactionAdmin:
        """The wrapped sync admin."""
        return self._sync

    @property
    def timeout_s(self) -> float:
        """The bound of a method call given no ``timeout``."""
        return self._sync.timeout_s

    @contextlib.asynccontextmanager
    async def bounded(self, timeout: float | None) -> AsyncIterator[None]:
        """Hold every call this task makes on this admin inside the block to one deadline.

        As :meth:`kafka2pc.TransactionAdmin.bounded`: each call ends by
        ``timeout`` seconds from now (``None``: the admin's ``timeout_s``); a
        call's own ``timeout`` can only make that earlier.  Past the deadline
        a call raises :class:`kafka2pc.BrokerUnavailableError`.
        """
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        outer = _deadline.get()
        token = _deadline.set(deadline if outer is None else min(outer, deadline))
        try:
            yield
        finally:
            _deadline.reset(token)

    async def diagnose_connection(self, *, timeout: float | None = None) -> KafkaTransactionError | None:
        """Why the cluster cannot be reached, if a second client can tell; ``None`` otherwise.

        :meth:`kafka2pc.TransactionAdmin.diagnose_connection`, in a thread of
        its own (it starts a short-lived librdkafka client).
        """
        self._fork_guard.check()
        return await asyncio.to_thread(self._sync.diagnose_connection, timeout=timeout)

    async def partitions(
        self,
        *,
        topic: str | None = None,
        partition: int | None = None,
        broker_id: int | None = None,
        timeout: float | None = None,
    ) -> list[TopicAndPartition]:
        """The partitions of ``topic`` (or only its ``partition``), or those ``broker_id`` leads, from metadata."""
        return await self._call(functools.partial(
            self._sync.partitions, topic=topic, partition=partition, broker_id=broker_id, timeout=timeout))

    async def describe_transaction(
        self, transactional_id: str, *, timeout: float | None = None
    ) -> TransactionInfo | None:
        """The coordinator's view of ``transactional_id`` (``None`` if unknown), with partition costs."""
        return await self._call(functools.partial(self._sync.describe_transaction, transactional_id, timeout=timeout))

    async def list_transactions(
        self,
        *,
        min_open_s: float | None = None,
        states: Collection[str] = (),
        timeout: float | None = None,
        min_open_ms: int | None = None,
    ) -> list[TransactionInfo]:
        """Transactions across the cluster, oldest first.

        Filters as :meth:`kafka2pc.TransactionAdmin.list_transactions`
        (``min_open_ms`` is the deprecated spelling of ``min_open_s``).
        """
        min_open_s = seconds_from_ms("list_transactions", "min_open_ms", min_open_ms, "min_open_s", min_open_s)
        return await self._call(
            functools.partial(self._sync.list_transactions, min_open_s=min_open_s, states=states, timeout=timeout)
        )

    async def force_terminate_transaction(
        self, transactional_id: str, *, only_ongoing: bool = False, timeout: float | None = None
    ) -> TransactionDescription | None:
        """Abort whatever is open under ``transactional_id`` and fence its producer; return the prior description."""
        return await self._call(functools.partial(
            self._sync.force_terminate_transaction, transactional_id, only_ongoing=only_ongoing, timeout=timeout))

    async def transaction_outcome(
        self, transactional_id: str, state: PreparedTxnState, *, settled: bool = False, timeout: float | None = None
    ) -> TransactionOutcome:
        """Ongoing, committed or aborted: what became of the transaction ``state`` names.

        As :meth:`kafka2pc.TransactionAdmin.transaction_outcome` (``settled=True``: only its anchor record is probed).
        """
        return await self._call(functools.partial(
            self._sync.transaction_outcome, transactional_id, state, settled=settled, timeout=timeout))

    async def plan_recovery(
        self, transactional_id: str, state: PreparedTxnState, *, timeout: float | None = None
    ) -> RecoveryPlan:
        """What :meth:`complete_transaction` would do, without doing it."""
        return await self._call(functools.partial(self._sync.plan_recovery, transactional_id, state, timeout=timeout))

    async def complete_transaction(
        self,
        transactional_id: str,
        state: PreparedTxnState,
        *,
        fence: bool = True,
        on_heuristic: OnHeuristic = "raise",
        timeout: float | None = None,
        raise_on_heuristic: bool | None = None,
    ) -> Settlement:
        """KIP-939 ``completeTransaction`` from any process: commit iff ``state`` is the open transaction.

        As :meth:`kafka2pc.TransactionAdmin.complete_transaction`
        (``raise_on_heuristic`` is the deprecated rc1 flag).

        Example::

            settlement = await admin.complete_transaction("orders-1", PreparedTxnState(stored_text))
            print(settlement.outcome)
        """
        return await self._call(
            functools.partial(
                self._sync.complete_transaction, transactional_id, state, fence=fence,
                on_heuristic=_heuristic("AsyncTransactionAdmin.complete_transaction", on_heuristic, raise_on_heuristic),
                timeout=timeout,
            )
        )

    @deprecated_alias("outcome_of", "transaction_outcome")
    async def outcome_of(self, state: PreparedTxnState, *, timeout: float | None = None) -> TransactionOutcome:
        """``await transaction_outcome(transactional_id, state, settled=True)``."""
        return await self._call(functools.partial(_probe_outcome, self._sync.control_plane, state, timeout))

    async def outcomes_of_settled(
        self, states: Mapping[str, PreparedTxnState], *, wait_s: float = 0.0, timeout: float | None = None
    ) -> dict[str, TransactionOutcome]:
        """The outcome of each settled transaction, asked again while unknown for up to ``wait_s``."""
        return await self._call(
            functools.partial(self._sync.outcomes_of_settled, states, wait_s=wait_s, timeout=timeout))

    async def settle_many(
        self,
        states: Mapping[str, PreparedTxnState],
        *,
        fence: bool = True,
        on_heuristic: OnHeuristic = "raise",
        on_settled: Callable[[str, Settlement], None] | None = None,
        markers_timeout_s: float = 10.0,
        timeout: float | None = None,
        raise_on_heuristic: bool | None = None,
    ) -> dict[str, Settlement]:
        """Settle each transactional id in ``states``, then wait for the markers.

        As :meth:`kafka2pc.TransactionAdmin.settle_many`; ``on_settled`` is
        called in the admin's thread, so it must not touch the event loop.
        """
        return await self._call(functools.partial(
            self._sync.settle_many, states, fence=fence,
            on_heuristic=_heuristic("AsyncTransactionAdmin.settle_many", on_heuristic, raise_on_heuristic),
            on_settled=on_settled, markers_timeout_s=markers_timeout_s, timeout=timeout,
        ))

    async def settle_open(
        self, matching: Callable[[str], bool], states: Mapping[str, PreparedTxnState], *, timeout: float | None = None
    ) -> dict[str, Decision]:
        """Settle every open transaction whose id is ``matching`` (``matching`` runs in the admin's thread)."""
        return await self._call(functools.partial(self._sync.settle_open, matching, states, timeout=timeout))

    async def describe_producers(
        self, partition: TopicAndPartition, *, timeout: float | None = None
    ) -> list[ProducerState]:
        """The active producers of ``partition`` (its leader's view)."""
        return await self._call(functools.partial(self._sync.describe_producers, partition, timeout=timeout))

    async def partition_lag(self, partition: TopicAndPartition, *, timeout: float | None = None) -> PartitionLag:
        """The last stable offset and high watermark of ``partition``."""
        return await self._call(functools.partial(self._sync.partition_lag, partition, timeout=timeout))

    async def held_back_partitions(
        self, *, topics: Collection[str] | None = None, timeout: float | None = None
    ) -> list[PartitionLag]:
        """Every partition whose last stable offset is below its high watermark (see the sync method)."""
        return await self._call(functools.partial(self._sync.held_back_partitions, topics=topics, timeout=timeout))

    async def find_hanging_transactions(
        self,
        partitions: Iterable[TopicAndPartition],
        *,
        max_transaction_timeout_s: float = TransactionAdmin.DEFAULT_MAX_TRANSACTION_TIMEOUT_MS / 1000,
        timeout: float | None = None,
        max_transaction_timeout_ms: int | None = None,
    ) -> list[OpenTransaction]:
        """Open transactions on ``partitions`` older than ``max_transaction_timeout_s``, judged hanging or not.

        As :meth:`kafka2pc.TransactionAdmin.find_hanging_transactions`
        (``max_transaction_timeout_ms`` is the deprecated spelling).
        """
        limit_s = seconds_from_ms("find_hanging_transactions", "max_transaction_timeout_ms",
                                  max_transaction_timeout_ms, "max_transaction_timeout_s", None)
        return await self._call(functools.partial(
            self._sync.find_hanging_transactions, list(partitions),
            max_transaction_timeout_s=max_transaction_timeout_s if limit_s is None else limit_s, timeout=timeout,
        ))

    async def abort_partition_transaction(
        self,
        partition: TopicAndPartition,
        producer_id: int,
        producer_epoch: int,
        *,
        coordinator_epoch: int = -1,
        timeout: float | None = None,
    ) -> PartitionLag:
        """Write the abort marker of a *hanging* transaction on one partition; the partition's offsets after."""
        return await self._call(functools.partial(
            self._sync.abort_partition_transaction, partition, producer_id, producer_epoch,
            coordinator_epoch=coordinator_epoch, timeout=timeout,
        ))

    async def topic_names(self, *, timeout: float | None = None) -> list[str]:
        """The names of every topic in the cluster."""
        return await self._call(functools.partial(self._sync.topic_names, timeout=timeout))

    async def max_transaction_timeout_s(self, *, timeout: float | None = None) -> float | None:
        """The largest transaction timeout a producer can use here, in seconds (``None`` if the broker does not say)."""
        return await self._call(functools.partial(self._sync.max_transaction_timeout_s, timeout=timeout))

    @deprecated_alias("max_transaction_timeout_ms", "max_transaction_timeout_s")
    async def max_transaction_timeout_ms(self, *, timeout: float | None = None) -> int | None:
        """The same limit in milliseconds."""
        limit_s = await self._call(functools.partial(self._sync.max_transaction_timeout_s, timeout=timeout))
        return None if limit_s is None else round(limit_s * 1000)

    async def pending_offset_groups(self, *, timeout: float | None = None) -> dict[str, list[TopicAndPartition]]:
        """Consumer groups whose committed offsets are pending in an open transaction, with those partitions."""
        return await self._call(functools.partial(self._sync.pending_offset_groups, timeout=timeout))

    async def pending_offset_holders(
        self, group_ids: Collection[str], *, timeout: float | None = None
    ) -> dict[str, list[int]]:
        """Per group: the producer ids whose open transaction holds its pending offsets (see the sync method)."""
        return await self._call(functools.partial(self._sync.pending_offset_holders, group_ids, timeout=timeout))

    async def consumer_offsets_partition(self, group_id: str, *, timeout: float | None = None) -> TopicAndPartition:
        """The ``__consumer_offsets`` partition that stores ``group_id``'s offsets (as the broker picks it)."""
        return await self._call(functools.partial(self._sync.consumer_offsets_partition, group_id, timeout=timeout))

    async def close(self, timeout: float | None = None) -> None:
        """Close the connections and stop the admin's thread (after the calls already queued).

        ``timeout`` as for :meth:`kafka2pc.TransactionAdmin.close`.  In a child
        forked after the admin was made it returns at once: the admin's thread
        lives only in the parent, and the inherited connections are left to it.
        """
        if self._closed:
            return
        if self._fork_guard.forked:
            self._closed = True
            self._sync.close(timeout)  # in the child: closes nothing, returns at once
            return
        try:
            await self._call(functools.partial(self._sync.close, timeout))
        finally:
            self._closed = True
            self._worker.stop()

    async def __aenter__(self) -> AsyncTransactionAdmin:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _call(self, fn: Callable[[], _T]) -> asyncio.Future[_T]:
        self._fork_guard.check()  # in a forked child the admin's thread is gone: a call would never return
        if self._closed:
            raise IllegalStateError("the admin is closed")
        deadline = _deadline.get()
        if deadline is not None:
            fn = functools.partial(_within, self._sync, deadline, fn)
        return self._worker.submit(asyncio.get_running_loop(), fn, _nothing)


def _within(admin: TransactionAdmin, deadline: float, fn: Callable[[], _T]) -> _T:
    """In the admin's thread: ``fn()`` inside :meth:`TransactionAdmin.bounded` up to ``deadline``."""
    with admin.bounded(max(0.0, deadline - time.monotonic())):
        return fn()


def _heuristic(where: str, on_heuristic: OnHeuristic, raise_on_heuristic: bool | None) -> OnHeuristic:
    """``on_heuristic``, or the value the deprecated ``raise_on_heuristic`` flag meant (it warns)."""
    return "raise" if on_heuristic_raises(where, on_heuristic, raise_on_heuristic) else "report"


def _nothing() -> None:
    pass


def _probe_outcome(ctrl: ControlPlane, state: PreparedTxnState, timeout: float | None) -> TransactionOutcome:
    """The deprecated ``outcome_of``: one probe of the anchor record (its warning given on the loop)."""
    with ctrl.deadline(timeout):
        return outcome_of(ctrl, state)
