"""Recovery policy: what to do with an in-doubt Kafka transaction, and doing it.

The network calls live in :mod:`kafka2pc._control`; this module only decides.
Given a transactional id and the :class:`PreparedTxnState` the application
stored (in the same database transaction as its data), :func:`plan` answers,
without changing anything:

* is the transaction open at the coordinator *the* prepared one?  (same
  producer id, and the anchor partition's leader reports the anchor offset as
  the producer's ``CurrentTxnStartOffset``) -> **commit** it;
* is some other transaction open under that id (e.g. transaction N+1 after the
  database kept N's state, or one whose database side rolled back) -> **abort** it;
* what became of the stored transaction itself (``read_committed`` probe of its
  anchor record): committed, aborted, unknown.  Aborted although the database
  committed is a *heuristic* outcome: reported, never hidden.

:func:`settle` carries the plan out with EndTxn and returns a
:class:`Settlement`.  Both work from any process: no producer is needed.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass

from kafka2pc._control import ControlPlane
from kafka2pc._exceptions import (
    HeuristicOutcomeError,
    IndefiniteOutcomeError,
    KafkaTransactionError,
    ProducerFencedError,
)
from kafka2pc._state import PreparedTxnState, topic_digest
from kafka2pc._types import TopicPartition, TransactionDescription

__all__ = ["Decision", "RecoveryPlan", "Settlement", "TransactionOutcome", "plan", "settle"]

logger = logging.getLogger(__name__)

_TRANSIENT_STATES = frozenset({"PrepareCommit", "PrepareAbort", "PrepareEpochFence"})
_INTERNAL_TOPICS = frozenset({"__consumer_offsets", "__transaction_state"})


class TransactionOutcome(str, enum.Enum):
    """What became of one transaction, as far as Kafka can tell."""

    ONGOING = "ongoing"
    """Still open: neither committed nor aborted."""
    COMMITTED = "committed"
    ABORTED = "aborted"
    NONE = "none"
    """The state names no records (empty state, or a transaction that wrote nothing)."""
    UNKNOWN = "unknown"
    """Kafka cannot tell (anchor deleted by retention, Java-form state, LSO pinned by another producer)."""


class Decision(str, enum.Enum):
    """What recovery does to the transaction open under a transactional id."""

    COMMIT = "commit"
    """The open transaction is the prepared one the database names: commit it."""
    ABORT = "abort"
    """Another transaction is open: abort it."""
    NOTHING = "nothing"
    """No transaction is open."""


@dataclass(frozen=True)
class RecoveryPlan:
    """The decision for one transactional id, made without changing anything.

    ``coordinator`` is the coordinator's description (``None`` if it does not
    know the id); ``stored_outcome`` is what became of the transaction named by
    ``state`` (``ONGOING`` when it is the open one); ``heuristic`` is True when
    Kafka aborted the transaction the database committed.
    """

    transactional_id: str
    state: PreparedTxnState
    coordinator: TransactionDescription | None
    decision: Decision
    stored_outcome: TransactionOutcome
    heuristic: bool
    reason: str


@dataclass(frozen=True)
class Settlement:
    """The result of :func:`settle`: the plan, and the final outcome of the stored transaction."""

    plan: RecoveryPlan
    outcome: TransactionOutcome

    @property
    def heuristic(self) -> bool:
        """True when Kafka aborted a transaction the database committed."""
        return self.outcome is TransactionOutcome.ABORTED and not self.plan.state.is_empty


def _describe_settled(ctrl: ControlPlane, tid: str, timeout_s: float) -> TransactionDescription | None:
    """DescribeTransactions, waiting out the transient PrepareCommit/PrepareAbort states."""
    deadline = time.monotonic() + timeout_s
    while True:
        desc = ctrl.describe_transaction(tid)
        if desc is None or desc.state not in _TRANSIENT_STATES or time.monotonic() > deadline:
            return desc
        time.sleep(0.05)


def _resolve_anchor_topic(topic: str, candidates: list[str]) -> str | None:
    if not topic.startswith("#"):
        return topic
    for name in candidates:
        if topic_digest(name) == topic:
            return name
    return None


def _is_open_prepared(ctrl: ControlPlane, desc: TransactionDescription, state: PreparedTxnState) -> bool:
    """Is the coordinator's open transaction exactly the one ``state`` names?"""
    if state.is_empty or desc.state != "Ongoing" or desc.producer_id != state.producer_id:
        return False
    anchor = state.anchor
    if state.format_version == 0:
        logger.warning(
            "state %s has no anchor (Java form): matching on producerId:epoch only, which cannot tell "
            "consecutive librdkafka transactions apart", state,
        )
        return desc.producer_epoch == state.epoch
    if state.sent_nothing:
        # The stored transaction sent nothing to Kafka, so nothing of it can be open:
        # whatever is open under the id is another transaction.
        return False
    if anchor is None:
        # Written by kafka2pc before offsets-only transactions got a marker record:
        # only an open transaction that wrote no record either (at most consumer
        # offsets) can be it, but consecutive ones cannot be told apart.
        logger.warning(
            "state %s has no anchor (written by an older kafka2pc): matching an offsets-only transaction "
            "on producerId:epoch only, which cannot tell consecutive librdkafka transactions apart", state,
        )
        return desc.producer_epoch == state.epoch and all(
            tp.topic in _INTERNAL_TOPICS for tp in desc.partitions
        )
    tp, offset = anchor
    topic = _resolve_anchor_topic(tp.topic, sorted({p.topic for p in desc.partitions}))
    if topic is None or TopicPartition(topic, tp.partition) not in desc.partitions:
        return False
    return _open_at(ctrl, TopicPartition(topic, tp.partition), desc.producer_id, offset)


def _open_at(ctrl: ControlPlane, tp: TopicPartition, producer_id: int, offset: int) -> bool:
    """Does ``producer_id`` have a transaction open on ``tp`` that started at ``offset`` (DescribeProducers)?"""
    return any(
        p.producer_id == producer_id and p.current_txn_start_offset == offset for p in ctrl.describe_producers(tp)
    )


def _anchor_partition(ctrl: ControlPlane, state: PreparedTxnState) -> tuple[TopicPartition, int] | None:
    """The anchor of ``state`` with its topic name resolved (``None``: no anchor, or the topic is gone)."""
    anchor = state.anchor
    if anchor is None:
        return None
    tp, offset = anchor
    topic = _resolve_anchor_topic(tp.topic, ctrl.topic_names())
    return None if topic is None else (TopicPartition(topic, tp.partition), offset)


def outcome_of(ctrl: ControlPlane, state: PreparedTxnState) -> TransactionOutcome:
    """What became of the transaction ``state`` names (a read-only probe of its anchor record)."""
    if state.is_empty:
        return TransactionOutcome.NONE
    if state.anchor is None:
        return TransactionOutcome.NONE if state.format_version == 1 else TransactionOutcome.UNKNOWN
    resolved = _anchor_partition(ctrl, state)
    if resolved is None:
        return TransactionOutcome.UNKNOWN
    return TransactionOutcome(ctrl.record_outcome(*resolved))


def _markers_pending(ctrl: ControlPlane, state: PreparedTxnState) -> bool:
    """Is the transaction ``state`` names still open on its anchor's partition (marker not written)?"""
    resolved = _anchor_partition(ctrl, state)
    return resolved is not None and _open_at(ctrl, resolved[0], state.producer_id, resolved[1])


def plan(
    ctrl: ControlPlane, transactional_id: str, state: PreparedTxnState, *, settle_timeout_s: float = 30.0,
    lso_wait_s: float = 5.0,
) -> RecoveryPlan:
    """Decide what recovery would do for ``transactional_id`` given the stored ``state``; change nothing.

    ``settle_timeout_s`` bounds the wait for the coordinator to leave
    PrepareCommit/PrepareAbort; ``lso_wait_s`` the wait for a decided
    transaction's marker to reach its anchor's partition.  When another
    producer's open transaction holds the last stable offset back, the stored
    transaction's outcome is reported as ``unknown`` at once.
    """
    state.check_transactional_id(transactional_id)
    desc = _describe_settled(ctrl, transactional_id, settle_timeout_s)
    is_open = desc is not None and desc.state == "Ongoing"
    if desc is not None and is_open and _is_open_prepared(ctrl, desc, state):
        return RecoveryPlan(
            transactional_id, state, desc, Decision.COMMIT, TransactionOutcome.ONGOING, False,
            "the open transaction is the prepared one the database committed",
        )
    stored = outcome_of(ctrl, state)
    deadline = time.monotonic() + lso_wait_s
    while (
        stored is TransactionOutcome.ONGOING and time.monotonic() < deadline and _markers_pending(ctrl, state)
    ):
        # Not the coordinator's open transaction, so it is decided, but its marker has
        # not reached the anchor's partition yet (seen right after a coordinator
        # resumed): that takes milliseconds, so wait for the real outcome.
        time.sleep(0.05)
        stored = outcome_of(ctrl, state)
    if stored is TransactionOutcome.ONGOING:
        # Another producer's open transaction holds the last stable offset back.
        stored = TransactionOutcome.UNKNOWN
    heuristic = stored is TransactionOutcome.ABORTED
    if is_open:
        reason = (
            "no prepared state stored: the open transaction was never recorded as committed"
            if state.is_empty
            else f"the open transaction is not the stored one (stored: {stored.value})"
        )
        decision = Decision.ABORT
    else:
        reason = f"no transaction open; stored transaction {stored.value}"
        decision = Decision.NOTHING
    if heuristic:
        reason += "; HEURISTIC: Kafka aborted a transaction the database committed"
    return RecoveryPlan(transactional_id, state, desc, decision, stored, heuristic, reason)


def settle(
    ctrl: ControlPlane,
    transactional_id: str,
    state: PreparedTxnState,
    *,
    raise_on_heuristic: bool = True,
    indefinite_retries: int = 5,
) -> Settlement:
    """Carry out :func:`plan`: commit the prepared transaction, or abort a stray one.

    Idempotent: settling again finds nothing open and reports the same outcome.
    Raises :class:`HeuristicOutcomeError` when Kafka aborted the stored
    transaction (unless ``raise_on_heuristic=False``).  An EndTxn without an
    answer is re-planned and retried up to ``indefinite_retries`` times, then
    raises :class:`IndefiniteOutcomeError`.
    """
    for attempt in range(indefinite_retries + 1):
        recovery_plan = plan(ctrl, transactional_id, state)
        try:
            return _carry_out(ctrl, recovery_plan, raise_on_heuristic)
        except IndefiniteOutcomeError as exc:
            # The EndTxn may or may not have landed (coordinator died, timeout).
            # Re-plan from scratch: the anchor check tells whether the prepared
            # transaction is still open, so a retry never commits another one.
            if attempt == indefinite_retries:
                raise
            logger.warning("%s: %s; re-planning (attempt %d of %d)", transactional_id, exc,
                           attempt + 1, indefinite_retries + 1)
            time.sleep(min(0.2 * 2**attempt, 5.0))
    raise AssertionError("unreachable")


def _carry_out(ctrl: ControlPlane, recovery_plan: RecoveryPlan, raise_on_heuristic: bool) -> Settlement:
    transactional_id, state = recovery_plan.transactional_id, recovery_plan.state
    desc = recovery_plan.coordinator
    outcome = recovery_plan.stored_outcome
    if recovery_plan.decision is not Decision.NOTHING and desc is not None:
        commit = recovery_plan.decision is Decision.COMMIT
        try:
            ctrl.end_txn(transactional_id, desc.producer_id, desc.producer_epoch, commit=commit)
        except (ProducerFencedError, HeuristicOutcomeError) as exc:
            # The coordinator settled it first (timeout abort, operator, another recoverer).
            logger.warning("%s: %s; re-reading the outcome", transactional_id, exc)
            outcome = _final_outcome(ctrl, state, exc)
        else:
            if commit:
                outcome = TransactionOutcome.COMMITTED
        logger.info(
            "recovery of %r: %s (%s) -> stored transaction %s",
            transactional_id, recovery_plan.decision.value, recovery_plan.reason, outcome.value,
        )
    settlement = Settlement(recovery_plan, outcome)
    if settlement.heuristic:
        logger.error(
            "HEURISTIC OUTCOME for %r: Kafka aborted the prepared transaction %s that the database "
            "committed (coordinator: %s)", transactional_id, state, desc,
        )
        if raise_on_heuristic:
            raise HeuristicOutcomeError(
                f"Kafka aborted the prepared transaction {state} of {transactional_id!r} although the "
                "database committed it (transaction timeout, or force-terminated); its records are not "
                "visible to read_committed consumers",
                transactional_id=transactional_id,
                state=state,
                outcome="aborted",
            )
    return settlement


def _final_outcome(ctrl: ControlPlane, state: PreparedTxnState, cause: KafkaTransactionError) -> TransactionOutcome:
    outcome = outcome_of(ctrl, state)
    if outcome in (TransactionOutcome.ONGOING, TransactionOutcome.UNKNOWN) and not state.is_empty:
        raise IndefiniteOutcomeError(
            f"could not settle {state}: {cause}; its outcome is {outcome.value}", state=state
        ) from cause
    return outcome
