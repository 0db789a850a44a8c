"""Recovery policy as pure generators over observations: no I/O, no sleeping, no clock.

A policy is a generator.  Each time it needs to know something about the
cluster (or the time), or wants something done, it *yields a request*
(:class:`DescribeTransaction`, :class:`DescribeProducers`, :class:`ListTopics`,
:class:`RecordOutcome`, :class:`EndTxn`, :class:`Sleep`, :class:`Clock`) and
receives the answer from whoever drives it.  An error answer is thrown into
the generator at the ``yield`` (``generator.throw``), so the policy handles a
fenced or unanswered EndTxn exactly where it asked for it.  Its return value
is the result (:class:`RecoveryPlan`, :class:`Settlement`,
:class:`TransactionOutcome`).

The sync driver (:func:`kafka2pc._recovery.run`) answers with a
:class:`~kafka2pc._control.ControlPlane`, ``time.sleep`` and
``time.monotonic``; an asyncio driver would answer the same requests with
``await`` and reuse every policy here unchanged; unit tests answer them from a
scripted cluster (``tests/unit/test_recovery_policy.py``).

What the policy decides, given a transactional id and the
:class:`PreparedTxnState` the application stored:

* is the transaction open at the coordinator *the* prepared one?  (same
  producer id, and the anchor partition's leader reports the anchor offset as
  the producer's ``CurrentTxnStartOffset``) -> **commit** it;
* is some other transaction open under that id (e.g. transaction N+1 after the
  database kept N's state, or one whose database side rolled back, or any
  transaction when the stored one sent nothing) -> **abort** it;
* what became of the stored transaction itself (``read_committed`` probe of its
  anchor record): committed, aborted, unknown.  Aborted although the database
  committed is a *heuristic* outcome: reported, never hidden.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kafka2pc._exceptions import (
    HeuristicOutcomeError,
    IndefiniteOutcomeError,
    KafkaTransactionError,
    ProducerFencedError,
)
from kafka2pc._state import PreparedTxnState, topic_digest
from kafka2pc._types import ProducerState, TopicAndPartition, TransactionDescription

__all__ = [
    "Clock",
    "Decision",
    "DescribeProducers",
    "DescribeTransaction",
    "EndTxn",
    "ListTopics",
    "Policy",
    "RecordOutcome",
    "RecoveryPlan",
    "Request",
    "Settlement",
    "Sleep",
    "TransactionOutcome",
    "await_completed",
    "decide",
    "plan_policy",
    "resolve_outcomes",
    "settle_policy",
    "stored_outcome",
]

logger = logging.getLogger("kafka2pc._recovery")

_T = TypeVar("_T")

TRANSIENT_STATES = frozenset({"PrepareCommit", "PrepareAbort", "PrepareEpochFence"})
INTERNAL_TOPICS = frozenset({"__consumer_offsets", "__transaction_state"})
POLL_INTERVAL_S = 0.05
"""Between two looks at a coordinator in a transient state, or at a marker not yet written."""
MARKER_POLL_INTERVAL_S = 0.005
"""Between two looks at a coordinator writing the markers of a transaction just ended (milliseconds' work)."""
OUTCOME_POLL_INTERVAL_S = 0.5
"""Between two probes of outcomes that are still unknown (a last stable offset held back)."""
LSO_WAIT_S = 5.0
"""How long a plan waits for a decided transaction's marker to reach its anchor's partition."""


# -- values ------------------------------------------------------------------------


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
    """The result of settling: the plan, and the final outcome of the stored transaction."""

    plan: RecoveryPlan
    outcome: TransactionOutcome

    @property
    def heuristic(self) -> bool:
        """True when Kafka aborted a transaction the database committed."""
        return self.outcome is TransactionOutcome.ABORTED and not self.plan.state.is_empty


# -- requests (what a policy asks its driver) -----------------------------------------


@dataclass(frozen=True)
class DescribeTransaction:
    """Answer: the coordinator's :class:`TransactionDescription`, or ``None`` if it does not know the id."""

    transactional_id: str


@dataclass(frozen=True)
class DescribeProducers:
    """Answer: the partition leader's list of :class:`ProducerState`."""

    partition: TopicAndPartition


@dataclass(frozen=True)
class ListTopics:
    """Answer: the names of every topic in the cluster."""


@dataclass(frozen=True)
class RecordOutcome:
    """Answer: ``"committed"``, ``"aborted"``, ``"ongoing"`` or ``"unknown"`` for the record at ``offset``."""

    partition: TopicAndPartition
    offset: int


@dataclass(frozen=True)
class EndTxn:
    """Do: commit or abort the open transaction of ``producer_id``/``producer_epoch``.  Answer: ``None``."""

    transactional_id: str
    producer_id: int
    producer_epoch: int
    commit: bool


@dataclass(frozen=True)
class Sleep:
    """Do: wait ``seconds``.  Answer: ``None``."""

    seconds: float


@dataclass(frozen=True)
class Clock:
    """Answer: a monotonic time in seconds."""


Request = DescribeTransaction | DescribeProducers | ListTopics | RecordOutcome | EndTxn | Sleep | Clock
Policy = Generator[Request, Any, _T]
"""A policy generator: yields requests, receives answers, returns its result."""


# -- pure helpers ---------------------------------------------------------------------


def resolve_anchor_topic(topic: str, candidates: Sequence[str]) -> str | None:
    """The topic name an anchor stands for (a ``#``-digest is looked up in ``candidates``)."""
    if not topic.startswith("#"):
        return topic
    for name in candidates:
        if topic_digest(name) == topic:
            return name
    return None


def producer_open_at(producers: Sequence[ProducerState], producer_id: int, offset: int) -> bool:
    """Does ``producer_id`` have a transaction open that started at ``offset`` (DescribeProducers answer)?"""
    return any(p.producer_id == producer_id and p.current_txn_start_offset == offset for p in producers)


def indefinite_retry_delay(attempt: int) -> float:
    """Seconds to wait before re-planning after the ``attempt``-th (0-based) unanswered EndTxn."""
    return float(min(0.2 * 2.0**attempt, 5.0))


def decide(
    transactional_id: str,
    state: PreparedTxnState,
    desc: TransactionDescription | None,
    stored: TransactionOutcome,
) -> RecoveryPlan:
    """The plan when the open transaction (if any) is *not* the prepared one, given the stored outcome."""
    if stored is TransactionOutcome.ONGOING:
        # Another producer's open transaction holds the last stable offset back.
        stored = TransactionOutcome.UNKNOWN
    heuristic = stored is TransactionOutcome.ABORTED
    is_open = desc is not None and desc.state == "Ongoing"
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


# -- policies -------------------------------------------------------------------------


def describe_settled(
    transactional_id: str, timeout_s: float, poll_s: float = POLL_INTERVAL_S
) -> Policy[TransactionDescription | None]:
    """DescribeTransactions, waiting out the transient PrepareCommit/PrepareAbort states."""
    deadline: float = (yield Clock()) + timeout_s
    while True:
        desc: TransactionDescription | None = yield DescribeTransaction(transactional_id)
        if desc is None or desc.state not in TRANSIENT_STATES or (yield Clock()) > deadline:
            return desc
        yield Sleep(poll_s)


def await_completed(transactional_ids: Sequence[str], timeout_s: float) -> Policy[list[str]]:
    """Wait until the coordinator has written the markers of transactions just ended; the ids still not done.

    EndTxn answers once the decision is logged (``PrepareCommit`` /
    ``PrepareAbort``); the markers that make the records readable (and let
    the next ``init_transactions`` of the id through without
    CONCURRENT_TRANSACTIONS) follow within milliseconds.  One ``timeout_s``
    for all of them; an id still transient then is returned, not waited for.
    """
    deadline: float = (yield Clock()) + timeout_s
    late: list[str] = []
    for tid in transactional_ids:
        left = max(0.0, deadline - (yield Clock()))
        desc = yield from describe_settled(tid, left, MARKER_POLL_INTERVAL_S)
        if desc is not None and desc.state in TRANSIENT_STATES:
            late.append(tid)
    return late


def resolve_outcomes(
    states: Mapping[str, PreparedTxnState], wait_s: float, poll_s: float = OUTCOME_POLL_INTERVAL_S
) -> Policy[dict[str, TransactionOutcome]]:
    """The outcome of each *settled* stored transaction, asked again while it is unknown, for up to ``wait_s``.

    A settled transaction's outcome is unknown while another producer's open
    transaction holds its partition's last stable offset back (e.g. a stray
    that is being aborted): asking again once that one ended gives the real
    answer, and an abort found only then is still a heuristic outcome that
    must be reported.  Every outcome is asked at least once.  A probe that
    still answers ``ongoing`` at the end is reported as ``UNKNOWN``: the
    transaction was settled, so it is the last stable offset that is held back.
    """
    deadline: float = (yield Clock()) + wait_s
    outcomes: dict[str, TransactionOutcome] = {}
    pending = dict(states)
    while True:
        for key, state in list(pending.items()):
            outcome = yield from stored_outcome(state)
            outcomes[key] = outcome
            if outcome not in (TransactionOutcome.ONGOING, TransactionOutcome.UNKNOWN):
                del pending[key]
        if not pending or (yield Clock()) >= deadline:
            break
        yield Sleep(poll_s)
    return {
        key: TransactionOutcome.UNKNOWN if outcome is TransactionOutcome.ONGOING else outcome
        for key, outcome in outcomes.items()
    }


def open_at(tp: TopicAndPartition, producer_id: int, offset: int) -> Policy[bool]:
    """Does ``producer_id`` have a transaction open on ``tp`` that started at ``offset``?"""
    producers: list[ProducerState] = yield DescribeProducers(tp)
    return producer_open_at(producers, producer_id, offset)


def is_open_prepared(desc: TransactionDescription, state: PreparedTxnState) -> Policy[bool]:
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
        return desc.producer_epoch == state.epoch and all(tp.topic in INTERNAL_TOPICS for tp in desc.partitions)
    tp, offset = anchor
    topic = resolve_anchor_topic(tp.topic, sorted({p.topic for p in desc.partitions}))
    if topic is None or TopicAndPartition(topic, tp.partition) not in desc.partitions:
        return False
    return (yield from open_at(TopicAndPartition(topic, tp.partition), desc.producer_id, offset))


def anchor_partition(state: PreparedTxnState) -> Policy[tuple[TopicAndPartition, int] | None]:
    """The anchor of ``state`` with its topic name resolved (``None``: no anchor, or the topic is gone)."""
    anchor = state.anchor
    if anchor is None:
        return None
    tp, offset = anchor
    topic = resolve_anchor_topic(tp.topic, (yield ListTopics()))
    return None if topic is None else (TopicAndPartition(topic, tp.partition), offset)


def stored_outcome(state: PreparedTxnState) -> Policy[TransactionOutcome]:
    """What became of the transaction ``state`` names (a read-only probe of its anchor record)."""
    if state.is_empty:
        return TransactionOutcome.NONE
    if state.anchor is None:
        return TransactionOutcome.NONE if state.format_version == 1 else TransactionOutcome.UNKNOWN
    resolved = yield from anchor_partition(state)
    if resolved is None:
        return TransactionOutcome.UNKNOWN
    answer: str = yield RecordOutcome(*resolved)
    return TransactionOutcome(answer)


def markers_pending(state: PreparedTxnState) -> Policy[bool]:
    """Is the transaction ``state`` names still open on its anchor's partition (marker not written)?"""
    resolved = yield from anchor_partition(state)
    if resolved is None:
        return False
    return (yield from open_at(resolved[0], state.producer_id, resolved[1]))


def plan_policy(
    transactional_id: str, state: PreparedTxnState, *, settle_timeout_s: float = 30.0, lso_wait_s: float = LSO_WAIT_S
) -> Policy[RecoveryPlan]:
    """Decide what recovery would do for ``transactional_id`` given the stored ``state``; change nothing.

    ``settle_timeout_s`` bounds the wait for the coordinator to leave
    PrepareCommit/PrepareAbort; ``lso_wait_s`` the wait for a decided
    transaction's marker to reach its anchor's partition.
    """
    state.check_transactional_id(transactional_id)
    desc = yield from describe_settled(transactional_id, settle_timeout_s)
    is_open = desc is not None and desc.state == "Ongoing"
    if desc is not None and is_open and (yield from is_open_prepared(desc, state)):
        return RecoveryPlan(
            transactional_id, state, desc, Decision.COMMIT, TransactionOutcome.ONGOING, False,
            "the open transaction is the prepared one the database committed",
        )
    stored = yield from stored_outcome(state)
    deadline: float = (yield Clock()) + lso_wait_s
    while stored is TransactionOutcome.ONGOING and (yield from markers_pending(state)):
        if (yield Clock()) >= deadline:
            anchor = state.anchor
            logger.warning(
                "%s: the stored transaction %s is not open at its coordinator (%s), yet its partition %s still "
                "holds it open after %.1f s: its marker was not written (Kafka skips the marker of a partition "
                "without a leader when a coordinator loads after an unclean restart). read_committed consumers "
                "of that partition stop there; its outcome is reported unknown (docs: guarantees, the limits)",
                transactional_id, state, desc.state if desc is not None else "unknown id",
                f"{anchor[0].topic}-{anchor[0].partition}" if anchor else "?", lso_wait_s,
            )
            break
        # Not the coordinator's open transaction, so it is decided, but its marker has
        # not reached the anchor's partition yet (seen right after a coordinator
        # resumed): that takes milliseconds, so wait for the real outcome.
        yield Sleep(POLL_INTERVAL_S)
        stored = yield from stored_outcome(state)
    return decide(transactional_id, state, desc, stored)


def settle_policy(
    transactional_id: str,
    state: PreparedTxnState,
    *,
    raise_on_heuristic: bool = True,
    indefinite_retries: int = 5,
    lso_wait_s: float = LSO_WAIT_S,
) -> Policy[Settlement]:
    """Plan, then commit the prepared transaction or abort a stray one; re-plan after an unanswered EndTxn.

    ``lso_wait_s`` as for :func:`plan_policy`.
    """
    for attempt in range(indefinite_retries + 1):
        recovery_plan = yield from plan_policy(transactional_id, state, lso_wait_s=lso_wait_s)
        try:
            return (yield from carry_out(recovery_plan, raise_on_heuristic))
        except IndefiniteOutcomeError as exc:
            # The EndTxn may or may not have landed (coordinator died, timeout).
            # Re-plan from scratch: the anchor check tells whether the prepared
            # transaction is still open, so a retry never commits another one.
            if attempt == indefinite_retries:
                raise
            logger.warning("%s: %s; re-planning (attempt %d of %d)", transactional_id, exc,
                           attempt + 1, indefinite_retries + 1)
            yield Sleep(indefinite_retry_delay(attempt))
    raise AssertionError("unreachable")


def carry_out(recovery_plan: RecoveryPlan, raise_on_heuristic: bool) -> Policy[Settlement]:
    """EndTxn as the plan says; read the outcome again if the coordinator settled it first."""
    transactional_id, state = recovery_plan.transactional_id, recovery_plan.state
    desc = recovery_plan.coordinator
    outcome = recovery_plan.stored_outcome
    if recovery_plan.decision is not Decision.NOTHING and desc is not None:
        commit = recovery_plan.decision is Decision.COMMIT
        try:
            yield EndTxn(transactional_id, desc.producer_id, desc.producer_epoch, commit)
        except (ProducerFencedError, HeuristicOutcomeError) as exc:
            # The coordinator settled it first (timeout abort, operator, another recoverer).
            logger.warning("%s: %s; re-reading the outcome", transactional_id, exc)
            outcome = yield from final_outcome(state, exc)
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


def final_outcome(state: PreparedTxnState, cause: KafkaTransactionError) -> Policy[TransactionOutcome]:
    """The stored transaction's outcome after an EndTxn the coordinator refused; unknown is indefinite."""
    outcome = yield from stored_outcome(state)
    if outcome in (TransactionOutcome.ONGOING, TransactionOutcome.UNKNOWN) and not state.is_empty:
        raise IndefiniteOutcomeError(
            f"could not settle {state}: {cause}; its outcome is {outcome.value}", state=state
        ) from cause
    return outcome
