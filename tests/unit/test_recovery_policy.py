"""The recovery policy, driven from a scripted cluster: pure logic, no broker, no sleeping.

Each test describes what the cluster would answer (coordinator description,
producers per partition, record outcomes, what EndTxn does) and drives the
policy generator with it, recording every request.  The same policies run
against real brokers through the sync driver in ``tests/core``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kafka2pc import (
    HeuristicOutcomeError,
    IndefiniteOutcomeError,
    PreparedTxnState,
    ProducerFencedError,
    TopicAndPartition,
    TransactionalIdMismatchError,
)
from kafka2pc._recovery_policy import (
    Clock,
    Decision,
    DescribeProducers,
    DescribeTransaction,
    EndTxn,
    ListTopics,
    Policy,
    RecordOutcome,
    Request,
    Sleep,
    TransactionOutcome,
    await_completed,
    indefinite_retry_delay,
    plan_policy,
    resolve_outcomes,
    settle_policy,
    stored_outcome,
)
from kafka2pc._types import ProducerState, TransactionDescription

TID = "orders-1"
TOPIC = TopicAndPartition("orders", 1)
OFFSETS = TopicAndPartition("__consumer_offsets", 7)
ANCHORS = TopicAndPartition("kafka2pc-anchors", 3)


def coordinator(state: str = "Ongoing", pid: int = 42, epoch: int = 0, *partitions: TopicAndPartition) -> TransactionDescription:
    return TransactionDescription(TID, state, pid, epoch, 60_000, 1, tuple(partitions), 1)


def producer(pid: int, start: int) -> ProducerState:
    return ProducerState(pid, 0, 5, 0, 0, start)


def anchored(tp: TopicAndPartition, offset: int, pid: int = 42, epoch: int = 0) -> PreparedTxnState:
    return PreparedTxnState._build(pid, epoch, TID, tp, offset)


@dataclass
class Cluster:
    """What the cluster answers; ``describe`` may be a list (one answer per call, last one repeated)."""

    describe: list[TransactionDescription | None] = field(default_factory=lambda: [None])
    producers: dict[TopicAndPartition, list[ProducerState]] = field(default_factory=dict)
    outcomes: dict[tuple[TopicAndPartition, int], list[str]] = field(default_factory=dict)
    topics: list[str] = field(default_factory=lambda: ["orders", "kafka2pc-anchors"])
    end_txn: Callable[[EndTxn], None] = lambda request: None
    now: float = 100.0
    requests: list[Request] = field(default_factory=list)

    def answer(self, request: Request) -> Any:
        self.requests.append(request)
        if isinstance(request, Clock):
            return self.now
        if isinstance(request, Sleep):
            self.now += request.seconds
            return None
        if isinstance(request, DescribeTransaction):
            return self.describe.pop(0) if len(self.describe) > 1 else self.describe[0]
        if isinstance(request, DescribeProducers):
            return self.producers.get(request.partition, [])
        if isinstance(request, ListTopics):
            return list(self.topics)
        if isinstance(request, RecordOutcome):
            answers = self.outcomes[(request.partition, request.offset)]
            return answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(request, EndTxn):
            self.end_txn(request)
            return None
        raise AssertionError(request)

    def of(self, kind: type) -> list[Any]:
        return [r for r in self.requests if isinstance(r, kind)]


def drive(policy: Policy[Any], cluster: Cluster) -> Any:
    """A pure driver: answers from ``cluster``, errors thrown into the policy like the real one."""
    answer: Any = None
    error: Exception | None = None
    while True:
        try:
            request = policy.throw(error) if error is not None else policy.send(answer)
        except StopIteration as stop:
            return stop.value
        answer, error = None, None
        try:
            answer = cluster.answer(request)
        except Exception as exc:  # noqa: BLE001 - thrown into the policy
            error = exc


# -- plan ----------------------------------------------------------------------------


def test_open_transaction_starting_at_the_anchor_is_committed() -> None:
    state = anchored(TOPIC, 10)
    cluster = Cluster(describe=[coordinator("Ongoing", 42, 0, TOPIC)], producers={TOPIC: [producer(42, 10)]})
    plan = drive(plan_policy(TID, state), cluster)
    assert plan.decision is Decision.COMMIT and plan.stored_outcome is TransactionOutcome.ONGOING
    assert cluster.of(DescribeProducers) == [DescribeProducers(TOPIC)]
    assert cluster.of(EndTxn) == [] and cluster.of(Sleep) == []  # planning changes nothing


def test_next_transaction_of_the_same_producer_and_epoch_is_aborted() -> None:
    """TV1: N+1 shares producerId:epoch with N; its start offset on the anchor partition differs."""
    state_n = anchored(TOPIC, 10)
    cluster = Cluster(
        describe=[coordinator("Ongoing", 42, 0, TOPIC)],
        producers={TOPIC: [producer(42, 14)]},
        outcomes={(TOPIC, 10): ["committed"]},
    )
    plan = drive(plan_policy(TID, state_n), cluster)
    assert plan.decision is Decision.ABORT and plan.stored_outcome is TransactionOutcome.COMMITTED
    assert not plan.heuristic


def test_offsets_only_transaction_is_matched_on_its_marker() -> None:
    state = anchored(ANCHORS, 4)
    open_txn = coordinator("Ongoing", 42, 0, OFFSETS, ANCHORS)
    assert drive(plan_policy(TID, state), Cluster([open_txn], {ANCHORS: [producer(42, 4)]})).decision is Decision.COMMIT
    next_cluster = Cluster([open_txn], {ANCHORS: [producer(42, 6)]}, {(ANCHORS, 4): ["committed"]})
    assert drive(plan_policy(TID, state), next_cluster).decision is Decision.ABORT


def test_state_that_sent_nothing_never_commits_an_open_transaction() -> None:
    state = PreparedTxnState._build(42, 0, TID, sent_nothing=True)
    cluster = Cluster(describe=[coordinator("Ongoing", 42, 0, OFFSETS)])
    plan = drive(plan_policy(TID, state), cluster)
    assert plan.decision is Decision.ABORT and plan.stored_outcome is TransactionOutcome.NONE
    assert cluster.of(DescribeProducers) == [] and cluster.of(RecordOutcome) == []


def test_legacy_unanchored_state_keeps_its_old_epoch_match() -> None:
    legacy = PreparedTxnState(str(PreparedTxnState._build(42, 0, TID)))
    assert drive(plan_policy(TID, legacy), Cluster([coordinator("Ongoing", 42, 0, OFFSETS)])).decision is Decision.COMMIT
    records_open = Cluster([coordinator("Ongoing", 42, 0, OFFSETS, TOPIC)])
    assert drive(plan_policy(TID, legacy), records_open).decision is Decision.ABORT


def test_java_form_matches_on_producer_id_and_epoch() -> None:
    java = PreparedTxnState("42:0")
    assert drive(plan_policy(TID, java), Cluster([coordinator("Ongoing", 42, 0, TOPIC)])).decision is Decision.COMMIT
    other_epoch = Cluster([coordinator("Ongoing", 42, 1, TOPIC)])
    plan = drive(plan_policy(TID, java), other_epoch)
    assert plan.decision is Decision.ABORT and plan.stored_outcome is TransactionOutcome.UNKNOWN


def test_empty_state_aborts_whatever_is_open() -> None:
    plan = drive(plan_policy(TID, PreparedTxnState()), Cluster([coordinator("Ongoing", 42, 0, TOPIC)]))
    assert plan.decision is Decision.ABORT and "no prepared state stored" in plan.reason


def test_nothing_open_reports_the_stored_outcome_and_a_heuristic_abort() -> None:
    state = anchored(TOPIC, 10)
    done = Cluster([coordinator("CompleteCommit", 42, 0)], outcomes={(TOPIC, 10): ["committed"]})
    plan = drive(plan_policy(TID, state), done)
    assert plan.decision is Decision.NOTHING and plan.stored_outcome is TransactionOutcome.COMMITTED
    aborted = Cluster([coordinator("CompleteAbort", 42, 0)], outcomes={(TOPIC, 10): ["aborted"]})
    plan = drive(plan_policy(TID, state), aborted)
    assert plan.decision is Decision.NOTHING and plan.heuristic and "HEURISTIC" in plan.reason


def test_transient_coordinator_states_are_waited_out_within_the_bound() -> None:
    state = anchored(TOPIC, 10)
    cluster = Cluster(
        describe=[coordinator("PrepareCommit", 42, 0, TOPIC)] * 3 + [coordinator("CompleteCommit", 42, 0)],
        outcomes={(TOPIC, 10): ["committed"]},
    )
    plan = drive(plan_policy(TID, state), cluster)
    assert plan.coordinator is not None and plan.coordinator.state == "CompleteCommit"
    assert cluster.of(Sleep) == [Sleep(0.05)] * 3

    stuck = Cluster(describe=[coordinator("PrepareAbort", 42, 0, TOPIC)], outcomes={(TOPIC, 10): ["ongoing"]})
    plan = drive(plan_policy(TID, state, settle_timeout_s=1.0, lso_wait_s=0.0), stuck)
    assert plan.coordinator is not None and plan.coordinator.state == "PrepareAbort"
    waited = sum(s.seconds for s in stuck.of(Sleep))
    assert 1.0 <= waited <= 1.1  # the clock (driver's answers) bounds the wait, not a real sleep


def test_decided_transaction_whose_marker_is_pending_is_waited_for() -> None:
    state = anchored(TOPIC, 10)
    cluster = Cluster(
        describe=[None],
        producers={TOPIC: [producer(42, 10)]},
        outcomes={(TOPIC, 10): ["ongoing", "ongoing", "committed"]},
    )
    plan = drive(plan_policy(TID, state), cluster)
    assert plan.stored_outcome is TransactionOutcome.COMMITTED and len(cluster.of(Sleep)) == 2


def test_marker_the_broker_never_writes_is_waited_for_lso_wait_s_then_reported_unknown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The coordinator completed the stored transaction; its partition still holds it open (a marker
    Kafka skipped): the plan waits ``lso_wait_s``, no longer, and decides nothing with the outcome
    unknown, with one WARNING naming the partition."""
    state = anchored(TOPIC, 10)
    cluster = Cluster(
        describe=[coordinator("CompleteCommit", 42, 0)],
        producers={TOPIC: [producer(42, 10)]},
        outcomes={(TOPIC, 10): ["ongoing"]},
    )
    with caplog.at_level("WARNING", logger="kafka2pc._recovery"):
        plan = drive(settle_policy(TID, state, lso_wait_s=0.5), cluster)
    waited = sum(s.seconds for s in cluster.of(Sleep))
    assert 0.5 <= waited <= 0.55
    assert plan.plan.decision is Decision.NOTHING and plan.outcome is TransactionOutcome.UNKNOWN
    assert cluster.of(EndTxn) == []
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "orders-1" in warning.getMessage() and "CompleteCommit" in warning.getMessage()


def test_lso_held_back_by_another_producer_is_unknown_at_once() -> None:
    state = anchored(TOPIC, 10)
    cluster = Cluster(describe=[None], producers={TOPIC: [producer(7, 3)]}, outcomes={(TOPIC, 10): ["ongoing"]})
    plan = drive(plan_policy(TID, state), cluster)
    assert plan.stored_outcome is TransactionOutcome.UNKNOWN and cluster.of(Sleep) == []


def test_digest_topic_is_resolved_against_the_cluster() -> None:
    long_topic = "t" * 240
    state = PreparedTxnState._build(42, 0, TID, TopicAndPartition(long_topic, 0), 9)
    assert state.anchor is not None and state.anchor[0].topic.startswith("#")
    cluster = Cluster(describe=[None], topics=["orders", long_topic], outcomes={(TopicAndPartition(long_topic, 0), 9): ["committed"]})
    assert drive(stored_outcome(state), cluster) is TransactionOutcome.COMMITTED
    gone = Cluster(describe=[None], topics=["orders"])
    assert drive(stored_outcome(state), gone) is TransactionOutcome.UNKNOWN


def test_state_of_another_transactional_id_is_refused() -> None:
    with pytest.raises(TransactionalIdMismatchError):
        drive(plan_policy("orders-2", anchored(TOPIC, 10)), Cluster())


# -- settle --------------------------------------------------------------------------


def test_settle_commits_the_prepared_transaction() -> None:
    cluster = Cluster(describe=[coordinator("Ongoing", 42, 0, TOPIC)], producers={TOPIC: [producer(42, 10)]})
    settlement = drive(settle_policy(TID, anchored(TOPIC, 10)), cluster)
    assert settlement.outcome is TransactionOutcome.COMMITTED
    assert cluster.of(EndTxn) == [EndTxn(TID, 42, 0, True)]


def test_settle_aborts_a_stray_transaction_and_reports_the_stored_one() -> None:
    cluster = Cluster(
        describe=[coordinator("Ongoing", 42, 0, TOPIC)],
        producers={TOPIC: [producer(42, 14)]},
        outcomes={(TOPIC, 10): ["committed"]},
    )
    settlement = drive(settle_policy(TID, anchored(TOPIC, 10)), cluster)
    assert settlement.outcome is TransactionOutcome.COMMITTED and not settlement.heuristic
    assert cluster.of(EndTxn) == [EndTxn(TID, 42, 0, False)]


def test_settle_raises_a_heuristic_outcome_unless_asked_not_to() -> None:
    def aborted() -> Cluster:
        return Cluster([coordinator("CompleteAbort", 42, 0)], outcomes={(TOPIC, 10): ["aborted"]})

    with pytest.raises(HeuristicOutcomeError) as raised:
        drive(settle_policy(TID, anchored(TOPIC, 10)), aborted())
    assert raised.value.outcome == "aborted"
    settlement = drive(settle_policy(TID, anchored(TOPIC, 10), raise_on_heuristic=False), aborted())
    assert settlement.heuristic


def test_unanswered_end_txn_is_re_planned_with_backoff() -> None:
    calls: list[EndTxn] = []

    def lost_once(request: EndTxn) -> None:
        calls.append(request)
        cluster.describe = [coordinator("CompleteCommit", 42, 0)]  # it landed after all
        raise IndefiniteOutcomeError("EndTxn got no answer")

    cluster = Cluster(
        describe=[coordinator("Ongoing", 42, 0, TOPIC)],
        producers={TOPIC: [producer(42, 10)]},
        outcomes={(TOPIC, 10): ["committed"]},
        end_txn=lost_once,
    )
    settlement = drive(settle_policy(TID, anchored(TOPIC, 10)), cluster)
    assert len(calls) == 1 and settlement.plan.decision is Decision.NOTHING
    assert settlement.outcome is TransactionOutcome.COMMITTED
    assert cluster.of(Sleep) == [Sleep(indefinite_retry_delay(0))]


def test_end_txn_never_answered_gives_up_after_the_retries() -> None:
    def never(request: EndTxn) -> None:
        raise IndefiniteOutcomeError("EndTxn got no answer")

    cluster = Cluster(
        describe=[coordinator("Ongoing", 42, 0, TOPIC)], producers={TOPIC: [producer(42, 10)]}, end_txn=never
    )
    with pytest.raises(IndefiniteOutcomeError):
        drive(settle_policy(TID, anchored(TOPIC, 10), indefinite_retries=3), cluster)
    assert len(cluster.of(EndTxn)) == 4
    assert [s.seconds for s in cluster.of(Sleep)] == [0.2, 0.4, 0.8]
    assert [indefinite_retry_delay(a) for a in range(7)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [("committed", TransactionOutcome.COMMITTED), ("aborted", None), ("ongoing", None), ("unknown", None)],
)
def test_end_txn_refused_because_settled_elsewhere(outcome: str, expected: TransactionOutcome | None) -> None:
    def fenced(request: EndTxn) -> None:
        raise ProducerFencedError("a newer epoch settled it")

    cluster = Cluster(
        describe=[coordinator("Ongoing", 42, 0, TOPIC)],
        producers={TOPIC: [producer(42, 10)]},
        outcomes={(TOPIC, 10): [outcome]},
        end_txn=fenced,
    )
    policy = settle_policy(TID, anchored(TOPIC, 10), indefinite_retries=0)
    if expected is not None:
        assert drive(policy, cluster).outcome is expected
    elif outcome == "aborted":
        with pytest.raises(HeuristicOutcomeError):
            drive(policy, cluster)
    else:
        with pytest.raises(IndefiniteOutcomeError, match=f"its outcome is {outcome}"):
            drive(policy, cluster)


# -- many transactions: markers, outcomes asked again --------------------------------------


def test_markers_of_ended_transactions_are_waited_for_at_a_short_poll() -> None:
    cluster = Cluster(describe=[coordinator("PrepareCommit", 42, 0, TOPIC)] * 2 + [coordinator("CompleteCommit")])
    assert drive(await_completed([TID], timeout_s=10.0), cluster) == []
    assert cluster.of(Sleep) == [Sleep(0.005)] * 2


def test_markers_not_written_within_the_bound_are_reported_not_waited_for() -> None:
    cluster = Cluster(describe=[coordinator("PrepareAbort", 42, 0, TOPIC)])
    assert drive(await_completed([TID, TID], timeout_s=0.5), cluster) == [TID, TID]
    assert 0.5 <= sum(s.seconds for s in cluster.of(Sleep)) <= 0.52  # one bound for all of them


def test_unknown_outcomes_are_asked_again_until_known_within_the_wait() -> None:
    first, second = anchored(TOPIC, 10), anchored(TOPIC, 20)
    cluster = Cluster(outcomes={(TOPIC, 10): ["committed"], (TOPIC, 20): ["unknown", "ongoing", "aborted"]})
    outcomes = drive(resolve_outcomes({"a": first, "b": second}, wait_s=60.0), cluster)
    assert outcomes == {"a": TransactionOutcome.COMMITTED, "b": TransactionOutcome.ABORTED}
    assert cluster.of(Sleep) == [Sleep(0.5)] * 2
    assert len(cluster.of(RecordOutcome)) == 4  # "a" once, "b" three times


def test_outcomes_still_unknown_after_the_wait_are_unknown_and_asked_at_least_once() -> None:
    state = anchored(TOPIC, 10)
    cluster = Cluster(outcomes={(TOPIC, 10): ["ongoing"]})
    assert drive(resolve_outcomes({"a": state}, wait_s=0.0), cluster) == {"a": TransactionOutcome.UNKNOWN}
    assert len(cluster.of(RecordOutcome)) == 1 and cluster.of(Sleep) == []
    waited = Cluster(outcomes={(TOPIC, 10): ["unknown"]})
    assert drive(resolve_outcomes({"a": state}, wait_s=2.0), waited) == {"a": TransactionOutcome.UNKNOWN}
    assert 2.0 <= sum(s.seconds for s in waited.of(Sleep)) <= 2.5
