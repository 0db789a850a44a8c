"""``TransactionAdmin``: KIP-939's admin API and the operator's view of transactions."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kafka2pc._control import ControlPlane
from kafka2pc._exceptions import UsageError
from kafka2pc._recovery import Decision, RecoveryPlan, Settlement, TransactionOutcome, outcome_of, plan, settle
from kafka2pc._state import PreparedTxnState
from kafka2pc._types import TopicPartition, TransactionDescription

__all__ = ["PartitionLag", "TransactionAdmin", "TransactionInfo"]

logger = logging.getLogger(__name__)

_OPEN_STATES = frozenset({"Ongoing", "PrepareCommit", "PrepareAbort", "PrepareEpochFence"})


@dataclass(frozen=True)
class PartitionLag:
    """What an open transaction costs ``read_committed`` consumers on one partition.

    ``held_back = high_watermark - last_stable_offset``: records (of any
    producer) that ``read_committed`` consumers cannot read yet.
    """

    topic: str
    partition: int
    last_stable_offset: int
    high_watermark: int

    @property
    def held_back(self) -> int:
        """Records hidden from ``read_committed`` consumers behind the last stable offset."""
        return max(0, self.high_watermark - self.last_stable_offset)


@dataclass(frozen=True)
class TransactionInfo:
    """One transaction as the coordinator sees it, with its age and its cost to consumers."""

    description: TransactionDescription
    open_for_ms: int
    """Milliseconds since the transaction started (``-1`` when none is open)."""
    partitions: tuple[PartitionLag, ...]

    @property
    def transactional_id(self) -> str:
        """The transactional id."""
        return self.description.transactional_id

    @property
    def state(self) -> str:
        """The coordinator's state (``Ongoing``, ``CompleteCommit``, ...)."""
        return self.description.state

    @property
    def is_open(self) -> bool:
        """True while the transaction is neither committed nor aborted."""
        return self.description.state in _OPEN_STATES


class TransactionAdmin:
    """Inspect, settle and terminate transactions from any process (no producer needed).

    Example::

        with TransactionAdmin({"bootstrap.servers": "localhost:9092"}) as admin:
            for info in admin.list_transactions(min_open_ms=60_000):
                print(info.transactional_id, info.open_for_ms)
            admin.force_terminate_transaction("orders-1")
    """

    def __init__(self, config: Mapping[str, Any], *, request_timeout_s: float = 30.0) -> None:
        self._ctrl = ControlPlane(config, request_timeout_s=request_timeout_s)

    @property
    def control_plane(self) -> ControlPlane:
        """The underlying coordinator client."""
        return self._ctrl

    def close(self) -> None:
        """Close the connections."""
        self._ctrl.close()

    def __enter__(self) -> TransactionAdmin:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def describe_transaction(self, transactional_id: str) -> TransactionInfo | None:
        """The coordinator's view of ``transactional_id`` (``None`` if unknown), with partition costs."""
        desc = self._ctrl.describe_transaction(transactional_id)
        return None if desc is None else self._info(desc)

    def list_transactions(
        self, *, min_open_ms: int | None = None, states: Collection[str] = ()
    ) -> list[TransactionInfo]:
        """Transactions across the cluster, oldest first.

        ``min_open_ms`` keeps only transactions open at least that long (so
        ``0`` lists every open transaction); ``states`` filters by coordinator state.
        """
        listings = self._ctrl.list_transactions(states=states)
        infos: list[TransactionInfo] = []
        for listing in listings:
            desc = self._ctrl.describe_transaction(listing.transactional_id)
            if desc is None:
                continue
            info = self._info(desc)
            if min_open_ms is not None and (not info.is_open or info.open_for_ms < min_open_ms):
                continue
            infos.append(info)
        return sorted(infos, key=lambda i: (-i.open_for_ms, i.transactional_id))

    def force_terminate_transaction(self, transactional_id: str) -> TransactionDescription | None:
        """Abort whatever transaction is open under ``transactional_id`` and fence its producer.

        KIP-939's ``forceTerminateTransaction``: InitProducerId with
        ``keepPreparedTxn=false``, which aborts and bumps the epoch.  Returns the
        coordinator's description from *before* termination (``None`` if the id
        is unknown, in which case nothing is sent).
        """
        before = self._ctrl.describe_transaction(transactional_id)
        if before is None:
            return None
        timeout_ms = before.timeout_ms if before.timeout_ms > 0 else 60_000
        result = self._ctrl.init_producer_id(transactional_id, transaction_timeout_ms=timeout_ms)
        logger.warning(
            "force-terminated %r (was %s, producer %d/%d; now epoch %d)",
            transactional_id, before.state, before.producer_id, before.producer_epoch, result.producer_epoch,
        )
        return before

    def transaction_outcome(self, transactional_id: str, state: PreparedTxnState) -> TransactionOutcome:
        """Ongoing, committed or aborted: what became of the transaction ``state`` names."""
        state.check_transactional_id(transactional_id)
        recovery_plan = plan(self._ctrl, transactional_id, state)
        if recovery_plan.stored_outcome is TransactionOutcome.ONGOING:
            return TransactionOutcome.ONGOING
        return outcome_of(self._ctrl, state)

    def plan_recovery(self, transactional_id: str, state: PreparedTxnState) -> RecoveryPlan:
        """What :meth:`complete_transaction` would do, without doing it."""
        return plan(self._ctrl, transactional_id, state)

    def complete_transaction(
        self,
        transactional_id: str,
        state: PreparedTxnState,
        *,
        fence: bool = True,
        raise_on_heuristic: bool = True,
    ) -> Settlement:
        """KIP-939 ``completeTransaction`` from any process: commit iff ``state`` is the open transaction.

        With ``fence=True``, when a transaction was committed or aborted, the
        producer id's epoch is bumped afterwards so an old instance still running
        is fenced.  When nothing was open nothing is sent, so a healthy running
        producer is left alone.
        """
        if not isinstance(state, PreparedTxnState):
            raise UsageError(f"state must be a PreparedTxnState, not {type(state).__name__}")
        settlement = settle(self._ctrl, transactional_id, state, raise_on_heuristic=raise_on_heuristic)
        if fence and settlement.plan.coordinator is not None and settlement.plan.decision is not Decision.NOTHING:
            timeout_ms = settlement.plan.coordinator.timeout_ms or 60_000
            self._ctrl.init_producer_id(transactional_id, transaction_timeout_ms=timeout_ms)
        return settlement

    def _info(self, desc: TransactionDescription) -> TransactionInfo:
        now_ms = int(time.time() * 1000)
        is_open = desc.state in _OPEN_STATES
        open_for = now_ms - desc.start_time_ms if is_open and desc.start_time_ms > 0 else -1
        lags = []
        if is_open:
            for tp in sorted(desc.partitions):
                lags.append(self._lag(tp))
        return TransactionInfo(desc, open_for, tuple(lags))

    def _lag(self, tp: TopicPartition) -> PartitionLag:
        _, lso, hw = self._ctrl.partition_offsets(tp)
        return PartitionLag(tp.topic, tp.partition, lso, hw)
