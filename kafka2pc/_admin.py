"""``TransactionAdmin``: KIP-939's admin API and the operator's view of transactions.

Every method is bounded: it finishes within its ``timeout`` (default: the
admin's ``timeout_s``, 30 s unless given) plus a small slack, whatever the
cluster does -- unreachable bootstrap, a broker that stops mid-call, a
coordinator that keeps answering "busy".  Past the bound it raises
:class:`BrokerUnavailableError`.  Methods over many transactions or
partitions say what their ``timeout`` bounds: each settlement
(``settle_many``, ``settle_open``), the probes plus ``wait_s``
(``outcomes_of_settled``), each request unless one is given
(``find_hanging_transactions``).

It is the one recovery facade: the dual-write and Spark recipes and the
``kafka2pc`` CLI settle, probe and terminate transactions through it, never
through the private modules (``tests/unit/test_import_boundaries.py``).
"""

from __future__ import annotations

import contextlib
import logging
import time
import typing
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any, ClassVar

from kafka2pc._control import DEFAULT_CONTROL_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S, ControlPlane
from kafka2pc._control._diagnosis import diagnose_unreachable
from kafka2pc._deprecation import deprecated_alias, renamed, seconds_from_ms
from kafka2pc._exceptions import KafkaTransactionError, UsageError
from kafka2pc._fork import ForkGuard, abandon
from kafka2pc._hanging import OpenTransaction, find_open_transactions
from kafka2pc._hanging import partitions as metadata_partitions
from kafka2pc._recovery import (
    Decision,
    RecoveryPlan,
    Settlement,
    TransactionOutcome,
    outcome_of,
    outcomes_of_settled,
    plan,
    settle,
    wait_for_markers,
)
from kafka2pc._state import PreparedTxnState
from kafka2pc._types import (
    OPEN_STATES,
    OnHeuristic,
    PartitionLag,
    ProducerState,
    TopicAndPartition,
    TransactionDescription,
    TransactionInfo,
)

__all__ = ["PartitionLag", "TransactionAdmin", "TransactionInfo", "on_heuristic_raises"]

logger = logging.getLogger(__name__)

_ON_HEURISTIC: tuple[OnHeuristic, ...] = typing.get_args(OnHeuristic)


def on_heuristic_raises(where: str, on_heuristic: str, raise_on_heuristic: bool | None) -> bool:
    """Whether a heuristic outcome raises, from ``on_heuristic`` (:data:`~kafka2pc.OnHeuristic`) or the deprecated flag.

    An admin stores no prepared state, so ``"acknowledge"`` reports the
    outcome as ``"report"`` does (the caller clears its own stored state).
    """
    if raise_on_heuristic is not None:
        renamed(f"{where}(raise_on_heuristic=...)", "on_heuristic='raise' or 'report'", stacklevel=4)
        return raise_on_heuristic
    if on_heuristic not in _ON_HEURISTIC:
        raise UsageError(
            f"{where}: on_heuristic must be one of {', '.join(map(repr, _ON_HEURISTIC))}, not {on_heuristic!r}"
        )
    return on_heuristic == "raise"


if not typing.TYPE_CHECKING:  # type checkers see no __getattr__, which would hide typos

    def __getattr__(name: str) -> Any:
        if name == "AdminOnHeuristic":  # its 1.0 name: the admin's policy is kafka2pc.OnHeuristic, as every settler's
            renamed("kafka2pc._admin.AdminOnHeuristic", "kafka2pc.OnHeuristic")
            return OnHeuristic
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

class TransactionAdmin:
    """Inspect, settle and terminate transactions from any process (no producer needed).

    The one recovery facade: the dual-write and Spark recipes and the
    ``kafka2pc`` CLI settle, probe and terminate transactions through it.

    Example::

        with TransactionAdmin({"bootstrap.servers": "localhost:9092"}) as admin:
            for info in admin.list_transactions(min_open_s=60):
                print(info.transactional_id, info.open_for_s)
            admin.force_terminate_transaction("orders-1")

    Used in a child process forked after it was made, every method raises
    :class:`ForkedProcessError` at once, before anything is sent (its
    connections belong to the parent): make it after the fork.
    """

    DEFAULT_MAX_TRANSACTION_TIMEOUT_MS: ClassVar[int] = 900_000
    """The broker's default ``transaction.max.timeout.ms`` (15 minutes, as in ``kafka-transactions.sh``): what
    :meth:`find_hanging_transactions` assumes unless told."""

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        timeout_s: float | None = None,
        request_timeout_s: float | None = None,
        control_plane: ControlPlane | None = None,
    ) -> None:
        """``config``: confluent-kafka style settings (only connection and security keys are used).

        ``timeout_s`` bounds each method call that is given no ``timeout``
        (default 30 s); ``request_timeout_s`` bounds each request on the wire,
        and connecting to the bootstrap servers (default: the smaller of
        ``timeout_s`` and 30 s).  ``control_plane`` shares the connections of
        another client (a producer's :attr:`TwoPhaseCommitProducer.control_plane`,
        or another admin's); :meth:`close` then leaves them open.
        """
        self._fork_guard = ForkGuard("TransactionAdmin")
        self._config = dict(config)
        self._owns_ctrl = control_plane is None
        if control_plane is not None:
            self._ctrl = control_plane
            return
        if timeout_s is None:
            timeout_s = DEFAULT_CONTROL_TIMEOUT_S
        if request_timeout_s is None:
            request_timeout_s = min(timeout_s, DEFAULT_REQUEST_TIMEOUT_S)
        self._ctrl = ControlPlane(config, request_timeout_s=request_timeout_s, timeout_s=timeout_s)

    @property
    def control_plane(self) -> ControlPlane:
        """The underlying coordinator client (pass it to a producer to share the connections)."""
        return self._ctrl

    @property
    def timeout_s(self) -> float:
        """The bound of a method call given no ``timeout``."""
        return self._ctrl.timeout_s

    def close(self, timeout: float | None = None) -> None:
        """Close the connections (unless they are shared: see ``control_plane`` in the constructor).

        Closing sockets does not wait on the network: it returns at once,
        well within any ``timeout`` (accepted for the signature every
        ``close`` of kafka2pc shares).  In a child forked after the admin was
        made it closes nothing: the inherited connections are left to the
        parent (they go away when the child exits).
        """
        if timeout is not None and timeout < 0:
            raise UsageError(f"close(timeout={timeout}): a timeout is in seconds and not negative")
        if self._fork_guard.forked:
            if self._owns_ctrl:
                abandon(self._ctrl)
            return
        if self._owns_ctrl:
            self._ctrl.close()

    @contextlib.contextmanager
    def bounded(self, timeout: float | None) -> Iterator[None]:
        """Hold every call this thread makes over these connections inside the block to one deadline.

        The calls of this admin, and of a producer that shares its
        connections, each end by ``timeout`` seconds from now (``None``: the
        admin's ``timeout_s``); a call's own ``timeout`` can only make that
        earlier.  Past the deadline a call raises :class:`BrokerUnavailableError`.
        """
        self._fork_guard.check()
        with self._ctrl.deadline(timeout):
            yield

    def diagnose_connection(self, *, timeout: float | None = None) -> KafkaTransactionError | None:
        """Why the cluster cannot be reached, if a second client can tell; ``None`` otherwise.

        kafka-python (the control plane) sees a failed SASL authentication or
        TLS handshake as a dropped connection.  This asks librdkafka, with the
        same settings, for at most ``timeout`` seconds: an
        :class:`AuthorizationError` for failed authentication, a
        :class:`BrokerUnavailableError` naming the TLS failure, or ``None``
        (plaintext connection, or nothing more to learn).
        """
        self._fork_guard.check()
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
        self._fork_guard.check()
        with self._ctrl.deadline(timeout):
            desc = self._ctrl.describe_transaction(transactional_id)
            return None if desc is None else self._info(desc)

    def list_transactions(
        self,
        *,
        min_open_s: float | None = None,
        states: Collection[str] = (),
        timeout: float | None = None,
        min_open_ms: int | None = None,
    ) -> list[TransactionInfo]:
        """Transactions across the cluster, oldest first.

        ``min_open_s`` keeps only transactions open at least that many
        seconds (so ``0`` lists every open transaction); ``states`` filters by
        coordinator state.  ``min_open_ms`` is its deprecated 0.1 spelling.
        """
        self._fork_guard.check()
        min_open_s = seconds_from_ms("list_transactions", "min_open_ms", min_open_ms, "min_open_s", min_open_s)
        with self._ctrl.deadline(timeout):
            listings = self._ctrl.list_transactions(states=states)
            descs = [d for d in map(self._ctrl.describe_transaction, (t.transactional_id for t in listings)) if d]
            # One clock reading for every age, and the order by start time: ages taken as each description
            # arrived (seconds apart on a loaded cluster) would not order the transactions by age.
            now_ms = int(time.time() * 1000)
            infos = [
                info for info in (self._info(desc, now_ms) for desc in descs)
                if min_open_s is None or (info.is_open and (info.open_for_s or 0.0) >= min_open_s)
            ]
        return sorted(infos, key=lambda i: (not i.is_open, i.description.start_time_ms, i.transactional_id))

    def force_terminate_transaction(
        self, transactional_id: str, *, only_ongoing: bool = False, timeout: float | None = None
    ) -> TransactionDescription | None:
        """Abort whatever transaction is open under ``transactional_id`` and fence its producer.

        KIP-939's ``forceTerminateTransaction``: InitProducerId with
        ``keepPreparedTxn=false``, which aborts and bumps the epoch.  Returns the
        coordinator's description from *before* termination, or ``None`` when
        nothing was sent: the id is unknown, or ``only_ongoing=True`` and no
        transaction is in state ``Ongoing`` (one already committing or aborting
        is left to finish).  Logs a WARNING when an ``Ongoing`` transaction was
        aborted, an INFO line when there was nothing open to end.
        """
        self._fork_guard.check()
        with self._ctrl.deadline(timeout):
            before = self._ctrl.describe_transaction(transactional_id)
            if before is None or (only_ongoing and before.state != "Ongoing"):
                return None
            result = self._ctrl.fence(transactional_id, before)
        if before.state == "Ongoing":
            logger.warning(
                "force-terminated %r: aborted its open transaction (producer %d/%d; now epoch %d)",
                transactional_id, before.producer_id, before.producer_epoch, result.producer_epoch,
            )
        else:
            logger.info(
                "fenced %r: nothing was open (state %s, producer %d/%d; now epoch %d)",
                transactional_id, before.state, before.producer_id, before.producer_epoch, result.producer_epoch,
            )
        return before

    def transaction_outcome(
        self, transactional_id: str, state: PreparedTxnState, *, settled: bool = False, timeout: float | None = None
    ) -> TransactionOutcome:
        """Ongoing, committed or aborted: what became of the transaction ``state`` names.

        The coordinator is asked first (an open transaction is ``ONGOING``),
        then the transaction's anchor record is probed.  ``settled=True``
        skips the coordinator: for a transaction known to be settled, by this
        process or another, one read-only probe of its anchor record (an open
        one reads as ``ONGOING`` or ``UNKNOWN``).
        """
        self._fork_guard.check()
        state.check_transactional_id(transactional_id)
        if settled:
            return self._probe_outcome(state, timeout)
        with self._ctrl.deadline(timeout):
            recovery_plan = plan(self._ctrl, transactional_id, state)
            if recovery_plan.stored_outcome is TransactionOutcome.ONGOING:
                return TransactionOutcome.ONGOING
            return outcome_of(self._ctrl, state)

    def plan_recovery(
        self, transactional_id: str, state: PreparedTxnState, *, timeout: float | None = None
    ) -> RecoveryPlan:
        """What :meth:`complete_transaction` would do, without doing it."""
        self._fork_guard.check()
        with self._ctrl.deadline(timeout):
            return plan(self._ctrl, transactional_id, state)

    def complete_transaction(
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

        With ``fence=True`` (the default, as in :meth:`settle_many`), when a
        transaction was committed or aborted, the producer id's epoch is
        bumped afterwards so an old instance still running is fenced.  When
        nothing was open nothing is sent, so a healthy running producer is
        left alone.  A heuristic outcome (Kafka aborted the transaction
        ``state`` names) raises :class:`HeuristicOutcomeError` with
        ``on_heuristic="raise"`` (default), or is reported in the
        :class:`Settlement` with ``"report"``.  ``raise_on_heuristic`` is the
        deprecated rc1 flag.
        """
        self._fork_guard.check()
        raises = on_heuristic_raises("TransactionAdmin.complete_transaction", on_heuristic, raise_on_heuristic)
        if not isinstance(state, PreparedTxnState):
            raise UsageError(f"state must be a PreparedTxnState, not {type(state).__name__}")
        with self._ctrl.deadline(timeout):
            settlement = settle(self._ctrl, transactional_id, state, raise_on_heuristic=raises)
            if fence and settlement.plan.coordinator is not None and settlement.plan.decision is not Decision.NOTHING:
                self._ctrl.fence(transactional_id, settlement.plan.coordinator)
        return settlement

    @deprecated_alias("outcome_of", "transaction_outcome")
    def outcome_of(self, state: PreparedTxnState, *, timeout: float | None = None) -> TransactionOutcome:
        """``transaction_outcome(transactional_id, state, settled=True)``."""
        self._fork_guard.check()
        return self._probe_outcome(state, timeout)

    def _probe_outcome(self, state: PreparedTxnState, timeout: float | None) -> TransactionOutcome:
        with self._ctrl.deadline(timeout):
            return outcome_of(self._ctrl, state)

    def outcomes_of_settled(
        self, states: Mapping[str, PreparedTxnState], *, wait_s: float = 0.0, timeout: float | None = None
    ) -> dict[str, TransactionOutcome]:
        """The outcome of each settled transaction (keyed as ``states``), asked again while unknown.

        A settled transaction's outcome is ``UNKNOWN`` while another open
        transaction holds its partition's last stable offset back.  Each is
        asked once, then again every 0.5 s while any is unknown, for up to
        ``wait_s``; those still unknown then are reported ``UNKNOWN``.  An
        ``ABORTED`` outcome of a transaction a database committed is a heuristic
        outcome.  The call ends within ``wait_s + timeout`` (``timeout``
        default: the admin's ``timeout_s``).
        """
        self._fork_guard.check()
        if wait_s < 0:
            raise UsageError(f"wait_s must not be negative, got {wait_s}")
        with self._ctrl.deadline(wait_s + (self.timeout_s if timeout is None else timeout)):
            return outcomes_of_settled(self._ctrl, states, wait_s=wait_s)

    def settle_many(
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
        """:meth:`complete_transaction` for each transactional id in ``states``, then wait for the markers.

        Settles in the order of ``states`` (``timeout`` bounds each one),
        calling ``on_settled(transactional_id, settlement)`` after each.  Then
        waits, for up to ``markers_timeout_s`` in all, until the coordinator
        has written the commit or abort markers of the transactions it ended,
        so that their records are readable and the ids can be initialised
        again at once when this returns.  ``fence`` as in
        :meth:`complete_transaction` (default ``True``; ``False`` leaves the
        epochs alone, for producers that end with the call).  With
        ``on_heuristic="raise"`` (default) the first heuristic outcome raises
        :class:`HeuristicOutcomeError` (the ids before it are settled);
        ``"report"`` reports each in its :class:`Settlement`.
        ``raise_on_heuristic`` is the deprecated rc1 flag.
        """
        self._fork_guard.check()
        raises = on_heuristic_raises("TransactionAdmin.settle_many", on_heuristic, raise_on_heuristic)
        heuristic: OnHeuristic = "raise" if raises else "report"
        settlements: dict[str, Settlement] = {}
        ended: list[str] = []
        for transactional_id, state in states.items():
            settlement = self.complete_transaction(
                transactional_id, state, fence=fence, on_heuristic=heuristic, timeout=timeout
            )
            settlements[transactional_id] = settlement
            if settlement.plan.decision is not Decision.NOTHING:
                ended.append(transactional_id)
            if on_settled is not None:
                on_settled(transactional_id, settlement)
        if ended:
            with self._ctrl.deadline(markers_timeout_s + self._ctrl.timeout_s):
                late = wait_for_markers(self._ctrl, ended, markers_timeout_s)
            if late:
                logger.warning("markers of %s not written after %.0f s", late, markers_timeout_s)
        return settlements

    def settle_open(
        self,
        matching: Callable[[str], bool],
        states: Mapping[str, PreparedTxnState],
        *,
        timeout: float | None = None,
    ) -> dict[str, Decision]:
        """Settle every open transaction whose transactional id is ``matching``: commit or abort it.

        One with a state in ``states`` is settled with it (committed if it is
        the transaction the state names, aborted otherwise; no fencing).  One
        ``states`` does not name is aborted with :meth:`force_terminate_transaction`
        (``only_ongoing=True``), which also fences a zombie producer still
        running.  Returns the decision taken per transactional id (only
        transactions that were open).  ``timeout`` bounds the listing, and
        each settlement.
        """
        self._fork_guard.check()
        with self._ctrl.deadline(timeout):
            listings = self._ctrl.list_transactions(states=["Ongoing"])
        decisions: dict[str, Decision] = {}
        for listing in listings:
            tid = listing.transactional_id
            if not matching(tid):
                continue
            state = states.get(tid)
            if state is not None:
                settlement = self.complete_transaction(tid, state, fence=False, on_heuristic="report",
                                                       timeout=timeout)
                logger.info("settled open transaction of %s: %s (%s)", tid, settlement.plan.decision.value,
                            settlement.plan.reason)
                decisions[tid] = settlement.plan.decision
                continue
            before = self.force_terminate_transaction(tid, only_ongoing=True, timeout=timeout)
            if before is not None:
                decisions[tid] = Decision.ABORT
        return decisions

    def describe_producers(self, partition: TopicAndPartition, *, timeout: float | None = None) -> list[ProducerState]:
        """The active producers of ``partition`` (its leader's view, DescribeProducers).

        A producer's ``current_txn_start_offset`` is the first offset of the
        transaction it has open there (``-1``: none): the partition's last
        stable offset cannot pass it until that transaction ends.
        """
        self._fork_guard.check()
        with self._ctrl.deadline(timeout):
            return self._ctrl.describe_producers(partition)

    def partition_lag(self, partition: TopicAndPartition, *, timeout: float | None = None) -> PartitionLag:
        """The last stable offset and high watermark of ``partition``: what open transactions hold back."""
        self._fork_guard.check()
        with self._ctrl.deadline(timeout):
            return self._lag(partition)

    def partitions(
        self,
        *,
        topic: str | None = None,
        partition: int | None = None,
        broker_id: int | None = None,
        timeout: float | None = None,
    ) -> list[TopicAndPartition]:
        """The partitions of ``topic`` (or only its ``partition``), or those ``broker_id`` leads, from metadata."""
        self._fork_guard.check()
        return metadata_partitions(self._config, topic=topic, partition=partition, broker_id=broker_id,
                                   timeout_s=self.timeout_s if timeout is None else timeout)

    def held_back_partitions(
        self, *, topics: Collection[str] | None = None, timeout: float | None = None
    ) -> list[PartitionLag]:
        """Every partition (of every topic, or of ``topics``) whose last stable offset is below its high watermark.

        Asks the partition leaders, not the coordinators, so it also finds a
        partition held back by a *hanging* transaction (one no coordinator
        has open).  Cost: one Metadata request and two ListOffsets requests
        per broker, whatever the number of partitions (a partition whose
        leader answered with an error is asked again on its own).
        ``timeout`` bounds the whole call.  A record appended between the
        two readings can show a partition held back for a moment: confirm it
        with :meth:`describe_producers` (a held-back partition has a producer
        with ``current_txn_start_offset`` equal to its last stable offset).
        """
        self._fork_guard.check()
        from kafka2pc._control._lag import held_back_partitions

        with self._ctrl.deadline(timeout):
            return held_back_partitions(self._ctrl, topics=topics)

    def find_hanging_transactions(
        self,
        partitions: Iterable[TopicAndPartition],
        *,
        max_transaction_timeout_s: float = DEFAULT_MAX_TRANSACTION_TIMEOUT_MS / 1000,
        timeout: float | None = None,
        max_transaction_timeout_ms: int | None = None,
    ) -> list[OpenTransaction]:
        """Open transactions on ``partitions`` older than ``max_transaction_timeout_s``, each judged hanging or not.

        As ``kafka-transactions.sh find-hanging``: one is *hanging* unless a
        coordinator has that producer id's transaction open with the partition
        in it.  ``max_transaction_timeout_s`` is the broker's
        ``transaction.max.timeout.ms`` in seconds (default 900); pass ``0`` to
        judge every open one.  ``timeout`` bounds the whole call; without it
        each request is bounded by the admin's ``timeout_s`` (a broker may lead
        thousands of partitions).  ``max_transaction_timeout_ms`` is the
        deprecated 0.1 spelling.
        """
        self._fork_guard.check()
        limit_s = seconds_from_ms("find_hanging_transactions", "max_transaction_timeout_ms",
                                  max_transaction_timeout_ms, "max_transaction_timeout_s", None)
        if limit_s is None:
            limit_s = max_transaction_timeout_s
        with self._ctrl.deadline(timeout) if timeout is not None else contextlib.nullcontext():
            return find_open_transactions(self._ctrl, partitions, max_transaction_timeout_ms=round(limit_s * 1000))

    def abort_partition_transaction(
        self,
        partition: TopicAndPartition,
        producer_id: int,
        producer_epoch: int,
        *,
        coordinator_epoch: int = -1,
        timeout: float | None = None,
    ) -> PartitionLag:
        """Write the abort marker of a producer's open transaction on one partition (WriteTxnMarkers).

        As ``kafka-transactions.sh abort``: for a *hanging* transaction, which
        no coordinator will ever end.  Never use it on a prepared two-phase
        transaction (settle those with :meth:`complete_transaction`).
        ``coordinator_epoch=-1`` skips the leader's coordinator-epoch check.
        Returns the partition's offsets afterwards.
        """
        self._fork_guard.check()
        with self._ctrl.deadline(timeout):
            self._ctrl.abort_partition_transaction(
                partition, producer_id, producer_epoch, coordinator_epoch=coordinator_epoch
            )
            logger.warning("aborted the open transaction of producer %d/%d on %s-%d", producer_id, producer_epoch,
                           partition.topic, partition.partition)
            return self._lag(partition)

    def topic_names(self, *, timeout: float | None = None) -> list[str]:
        """The names of every topic in the cluster."""
        self._fork_guard.check()
        with self._ctrl.deadline(timeout):
            return self._ctrl.topic_names()

    def max_transaction_timeout_s(self, *, timeout: float | None = None) -> float | None:
        """The largest transaction timeout a producer can use here, in seconds (``None`` if the broker does not say).

        The broker's ``transaction.max.timeout.ms``, capped at librdkafka's
        limit of 2**31 microseconds (above it librdkafka's request timeouts
        wrap around).  Set ``transaction.timeout.ms`` (Kafka's key, in
        milliseconds) to at most ``1000 *`` this.
        """
        self._fork_guard.check()
        limit_ms = self._max_transaction_timeout_ms(timeout)
        return None if limit_ms is None else limit_ms / 1000

    @deprecated_alias("max_transaction_timeout_ms", "max_transaction_timeout_s")
    def max_transaction_timeout_ms(self, *, timeout: float | None = None) -> int | None:
        """The same limit in milliseconds."""
        self._fork_guard.check()
        return self._max_transaction_timeout_ms(timeout)

    def _max_transaction_timeout_ms(self, timeout: float | None) -> int | None:
        from kafka2pc._producer_config import LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS

        with self._ctrl.deadline(timeout):
            limit = self._ctrl.broker_config(["transaction.max.timeout.ms"]).get("transaction.max.timeout.ms")
        return min(int(limit), LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS) if limit else None

    def pending_offset_groups(self, *, timeout: float | None = None) -> dict[str, list[TopicAndPartition]]:
        """Consumer groups whose committed offsets are pending in an open transaction, with those partitions.

        A transaction that sent a group's offsets (``send_offsets_to_transaction``)
        holds them until it ends; meanwhile ``OffsetFetch`` with
        ``require_stable`` answers ``UNSTABLE_OFFSET_COMMIT`` and a consumer
        (re)starting in the group waits.  The transaction holding a group's
        offsets lists :meth:`consumer_offsets_partition` of the group among its
        partitions.  A brand-new group whose first offsets are pending is
        reported too.  Cost: none beyond a scan of ``__consumer_offsets``'s
        offsets (:meth:`held_back_partitions`) when no group has pending
        offsets; else ``ListGroups`` per broker and one ``OffsetFetch``
        naming every partition of the cluster per group stored in a held-back
        ``__consumer_offsets`` partition.  ``timeout`` bounds the whole call.
        """
        self._fork_guard.check()
        from kafka2pc._control._groups import pending_offset_groups

        with self._ctrl.deadline(timeout):
            return pending_offset_groups(self._ctrl)

    def pending_offset_holders(
        self, group_ids: Collection[str], *, timeout: float | None = None
    ) -> dict[str, list[int]]:
        """Per group: the producer ids whose open transaction holds the group's pending offsets.

        Several groups share a ``__consumer_offsets`` partition, so the
        transactions a coordinator lists with that partition may hold another
        group's offsets.  This reads the partition's open transactional
        records (from the first open transaction there to its end, at most
        16 MiB; past that every producer with a transaction open there is
        given) and names, per group, the producers whose records carry its
        offsets.  Map a producer id to its transactional id with
        :meth:`list_transactions`.  ``timeout`` bounds the whole call.
        """
        self._fork_guard.check()
        from kafka2pc._control._groups import pending_offset_holders

        with self._ctrl.deadline(timeout):
            return pending_offset_holders(self._ctrl, group_ids)

    def consumer_offsets_partition(self, group_id: str, *, timeout: float | None = None) -> TopicAndPartition:
        """The ``__consumer_offsets`` partition that stores ``group_id``'s offsets (as the broker picks it)."""
        self._fork_guard.check()
        from kafka2pc._control._groups import (
            CONSUMER_OFFSETS_TOPIC,
            consumer_offsets_partition_count,
            offsets_partition,
        )

        with self._ctrl.deadline(timeout):
            count = consumer_offsets_partition_count(self._ctrl.session)
        if count <= 0:
            raise UsageError(f"{CONSUMER_OFFSETS_TOPIC} does not exist yet: no group has committed offsets")
        return TopicAndPartition(CONSUMER_OFFSETS_TOPIC, offsets_partition(group_id, count))

    def _info(self, desc: TransactionDescription, now_ms: int | None = None) -> TransactionInfo:
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        is_open = desc.state in OPEN_STATES
        open_for = max(0, now_ms - desc.start_time_ms) / 1000 if is_open and desc.start_time_ms > 0 else None
        lags = []
        if is_open:
            for tp in sorted(desc.partitions):
                lags.append(self._lag(tp))
        return TransactionInfo(desc, open_for, tuple(lags))

    def _lag(self, tp: TopicAndPartition) -> PartitionLag:
        _, lso, hw = self._ctrl.partition_offsets(tp)
        return PartitionLag(tp.topic, tp.partition, lso, hw)
