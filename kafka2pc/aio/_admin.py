"""``AsyncTransactionAdmin``: :class:`kafka2pc.TransactionAdmin` for asyncio.

The control plane (kafka-python requests to coordinators and partition
leaders) runs in one dedicated thread per admin, in call order, so a
coordinator that does not answer delays the awaiting task, never the loop.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from kafka2pc import (
    IllegalStateError,
    PreparedTxnState,
    RecoveryPlan,
    Settlement,
    TransactionAdmin,
    TransactionInfo,
    TransactionOutcome,
)
from kafka2pc._types import TransactionDescription  # what force_terminate_transaction returns
from kafka2pc.aio._worker import SerialWorker

__all__ = ["AsyncTransactionAdmin"]

_T = TypeVar("_T")


class AsyncTransactionAdmin:
    """Inspect, settle and terminate transactions from an event loop (no producer needed).

    Each method is the coroutine counterpart of the
    :class:`kafka2pc.TransactionAdmin` method of the same name, with the same
    arguments, results and errors.  Cancelling an awaiting task does not
    interrupt the request: it completes in the admin's thread.

    Example (recovery at start-up, e.g. from a FastAPI lifespan)::

        async with AsyncTransactionAdmin({"bootstrap.servers": "localhost:9092"}) as admin:
            settlement = await admin.complete_transaction("orders-1", PreparedTxnState(stored_text))
            for info in await admin.list_transactions(min_open_ms=60_000):
                logger.warning("%s open for %d ms", info.transactional_id, info.open_for_ms)
    """

    def __init__(self, config: Mapping[str, Any], *, request_timeout_s: float = 30.0) -> None:
        self._sync = TransactionAdmin(config, request_timeout_s=request_timeout_s)
        self._worker = SerialWorker("kafka2pc-aio-admin")
        self._closed = False

    @property
    def sync_admin(self) -> TransactionAdmin:
        """The wrapped sync admin."""
        return self._sync

    async def describe_transaction(self, transactional_id: str) -> TransactionInfo | None:
        """The coordinator's view of ``transactional_id`` (``None`` if unknown), with partition costs."""
        return await self._call(functools.partial(self._sync.describe_transaction, transactional_id))

    async def list_transactions(
        self, *, min_open_ms: int | None = None, states: Collection[str] = ()
    ) -> list[TransactionInfo]:
        """Transactions across the cluster, oldest first.

        Filters as :meth:`kafka2pc.TransactionAdmin.list_transactions`.
        """
        return await self._call(
            functools.partial(self._sync.list_transactions, min_open_ms=min_open_ms, states=states)
        )

    async def force_terminate_transaction(self, transactional_id: str) -> TransactionDescription | None:
        """Abort whatever is open under ``transactional_id`` and fence its producer; return the prior description."""
        return await self._call(functools.partial(self._sync.force_terminate_transaction, transactional_id))

    async def transaction_outcome(self, transactional_id: str, state: PreparedTxnState) -> TransactionOutcome:
        """Ongoing, committed or aborted: what became of the transaction ``state`` names."""
        return await self._call(functools.partial(self._sync.transaction_outcome, transactional_id, state))

    async def plan_recovery(self, transactional_id: str, state: PreparedTxnState) -> RecoveryPlan:
        """What :meth:`complete_transaction` would do, without doing it."""
        return await self._call(functools.partial(self._sync.plan_recovery, transactional_id, state))

    async def complete_transaction(
        self,
        transactional_id: str,
        state: PreparedTxnState,
        *,
        fence: bool = True,
        raise_on_heuristic: bool = True,
    ) -> Settlement:
        """KIP-939 ``completeTransaction`` from any process: commit iff ``state`` is the open transaction.

        Example::

            settlement = await admin.complete_transaction("orders-1", PreparedTxnState(stored_text))
            print(settlement.outcome)
        """
        return await self._call(
            functools.partial(
                self._sync.complete_transaction, transactional_id, state,
                fence=fence, raise_on_heuristic=raise_on_heuristic,
            )
        )

    async def close(self) -> None:
        """Close the connections and stop the admin's thread (after the calls already queued)."""
        if self._closed:
            return
        try:
            await self._call(self._sync.close)
        finally:
            self._closed = True
            self._worker.stop()

    async def __aenter__(self) -> AsyncTransactionAdmin:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _call(self, fn: Callable[[], _T]) -> asyncio.Future[_T]:
        if self._closed:
            raise IllegalStateError("the admin is closed")
        return self._worker.submit(asyncio.get_running_loop(), fn, _nothing)


def _nothing() -> None:
    pass
