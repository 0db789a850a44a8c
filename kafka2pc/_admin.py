"""``TransactionAdmin``: KIP-939's admin API and the operator's view of transactions.

Every method is bounded: it finishes within its ``timeout`` (default: the
admin's ``timeout_s``, 30 s unless given) plus a small slack, whatever the
cluster does -- unreachable bootstrap, a broker that stops mid-call, a
coordinator that keeps answering "busy".  Past the bound it raises
:class:`BrokerUnavailableError`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kafka2pc._control import DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_TIMEOUT_S, ControlPlane
from kafka2pc._control._diagnosis import diagnose_unreachable
from kafka2pc._exceptions import KafkaTransactionError, UsageError
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

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        timeout_s: float | None = None,
        request_timeout_s: float | None = None,
    ) -> None:
        """``config``: confluent-kafka style settings (only connection and security keys are used).

        ``timeout_s`` bounds each method call that is given no ``timeout``
        (default 30 s); ``request_timeout_s`` bounds each request on the wire,
        and connecting to the bootstrap servers (default: the smaller of
        ``timeout_s`` and 30 s).
        """
        if timeout_s is None:
            timeout_s = DEFAULT_TIMEOUT_S
        if request_timeout_s is None:
            request_timeout_s = min(timeout_s, DEFAULT_REQUEST_TIMEOUT_S)
        self._config = dict(config)
        self._ctrl = ControlPlane(config, request_timeout_s=request_timeout_s, timeout_s=timeout_s)

    @property
    def control_plane(self) -> ControlPlane:
        """The underlying coordinator client."""
        return self._ctrl

    @property
    def timeout_s(self) -> float:
        """The bound of a method call given no ``timeout``."""
        return self._ctrl.timeout_s

    def close(self) -> None:
        """Close the connections."""
        self._ctrl.close()

    def diagnose_connection(self, *, timeout: float | None = None) -> KafkaTransactionError | None:
        """Why the cluster cannot be reached, if a second client can tell; ``None`` otherwise.

        kafka-python (the control plane) sees a failed SASL authentication or
        TLS handshake as a dropped connection.  This asks librdkafka, with the
        same settings, for at most ``timeout`` seconds: an
        :class:`AuthorizationError` for failed authentication, a
        :class:`BrokerUnavailableError` naming the TLS failure, or ``None``
        (plaintext connection, or nothing more to learn).
        """
        timeout_s = self.timeout_s if timeout is None else timeout
        from kafka2pc._control import librdkafka_connection_config

        return diagnose_unreachable(librdkafka_connection_config(self._config), timeout_s)

    def __enter__(self) -> TransactionAdmin:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def describe_transaction(
        self, transactional_id: str, *, timeout: float | None = None
    ) -> TransactionInfo | None:
        """The coordinator's view of ``transactional_id`` (``None`` if unknown), with partition costs."""
        with self._ctrl.deadline(timeout):
            desc = self._ctrl.describe_transaction(transactional_id)
            return None if desc is None else self._info(desc)

    def list_transactions(
        self, *, min_open_ms: int | None = None, states: Collection[str] = (), timeout: float | None = None
    ) -> list[TransactionInfo]:
        """Transactions across the cluster, oldest first.

        ``min_open_ms`` keeps only transactions open at least that long (so
        ``0`` lists every open transaction); ``states`` filters by coordinator state.
        """
        with self._ctrl.deadline(timeout):
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

    def force_terminate_transaction(
        self, transactional_id: str, *, only_ongoing: bool = False, timeout: float | None = None
    ) -> TransactionDescription | None:
        """Abort whatever transaction is open under ``transactional_id`` and fence its producer.

        KIP-939's ``forceTerminateTransaction``: InitProducerId with
        ``keepPreparedTxn=false``, which aborts and bumps the epoch.  Returns the
        coordinator's description from *before* termination, or ``None`` when
        nothing was sent: the id is unknown, or ``only_ongoing=True`` and no
        transaction is in state ``Ongoing`` (one already committing or aborting
        is left to finish).
        """
        with self._ctrl.deadline(timeout):
            before = self._ctrl.describe_transaction(transactional_id)
            if before is None or (only_ongoing and before.state != "Ongoing"):
                return None
            result = self._ctrl.fence(transactional_id, before)
        logger.warning(
            "force-terminated %r (was %s, producer %d/%d; now epoch %d)",
            transactional_id, before.state, before.producer_id, before.producer_epoch, result.producer_epoch,
        )
        return before

    def transaction_outcome(
        self, transactional_id: str, state: PreparedTxnState, *, timeout: float | None = None
    ) -> TransactionOutcome:
        """Ongoing, committed or aborted: what became of the transaction ``state`` names."""
        state.check_transactional_id(transactional_id)
        with self._ctrl.deadline(timeout):
            recovery_plan = plan(self._ctrl, transactional_id, state)
            if recovery_plan.stored_outcome is TransactionOutcome.ONGOING:
                return TransactionOutcome.ONGOING
            return outcome_of(self._ctrl, state)

    def plan_recovery(
        self, transactional_id: str, state: PreparedTxnState, *, timeout: float | None = None
    ) -> RecoveryPlan:
        """What :meth:`complete_transaction` would do, without doing it."""
        with self._ctrl.deadline(timeout):
            return plan(self._ctrl, transactional_id, state)

    def complete_transaction(
        self,
        transactional_id: str,
        state: PreparedTxnState,
        *,
        fence: bool = True,
        raise_on_heuristic: bool = True,
        timeout: float | None = None,
    ) -> Settlement:
        """KIP-939 ``completeTransaction`` from any process: commit iff ``state`` is the open transaction.

        With ``fence=True``, when a transaction was committed or aborted, the
        producer id's epoch is bumped afterwards so an old instance still running
        is fenced.  When nothing was open nothing is sent, so a healthy running
        producer is left alone.
        """
        if not isinstance(state, PreparedTxnState):
            raise UsageError(f"state must be a PreparedTxnState, not {type(state).__name__}")
        with self._ctrl.deadline(timeout):
            settlement = settle(self._ctrl, transactional_id, state, raise_on_heuristic=raise_on_heuristic)
            if fence and settlement.plan.coordinator is not None and settlement.plan.decision is not Decision.NOTHING:
                self._ctrl.fence(transactional_id, settlement.plan.coordinator)
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
