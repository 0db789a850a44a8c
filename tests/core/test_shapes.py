"""Every shape of transaction is named exactly: N committed, N+1 prepared, ``kill -9``, complete(state N).

A child commits a first transaction with records *and* consumer offsets, then
transaction N of one shape (its state stored with its database rows), then
prepares transaction N+1 of another shape without committing its database
side, and is killed.  A new process runs ``init_transactions(keep_prepared_txn=True)``
and ``complete_transaction(state N)``.  N+1 must be aborted and N's effects
must stay, as a ``read_committed`` consumer, the group's committed offset and
the database see them.  Before the marker record, an offsets-only N+1 was
*committed* here (its state and N's were the same string).

Shapes: ``records`` (2 keyed records over 2 partitions), ``offsets`` (consumer offsets only, anchored
on a marker record), ``empty`` (nothing sent).  Every broker line of CI's matrix (4.4.0, 4.3.1, 3.9.2).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from harness.scenario import Scenario

from kafka2pc import (
    Decision,
    PreparedTxnState,
    TransactionOutcome,
    TwoPhaseCommitProducer,
    TxnState,
)
from kafka2pc._control import ControlPlane

ScenarioFactory = Callable[..., Scenario]

FIRST_POSITION = 3
SHAPES = {"records": "4", "offsets": "0@5", "empty": "0"}
NEXT = {"records": "4", "offsets": "0@10", "empty": "0"}
PAIRS = [
    ("records", "records"),
    ("records", "offsets"),
    ("offsets", "records"),
    ("offsets", "offsets"),
    ("empty", "empty"),
    ("empty", "records"),
    ("empty", "offsets"),
    ("offsets", "empty"),
]


def _outcome(bootstrap: str, state: PreparedTxnState) -> str:
    anchor = state.anchor
    assert anchor is not None
    with ControlPlane({"bootstrap.servers": bootstrap}) as ctrl:
        return ctrl.record_outcome(*anchor)


@pytest.mark.parametrize(("shape_n", "shape_next"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_complete_with_state_n_aborts_prepared_n_plus_1(
    any_kafka_bootstrap: str, scenario_factory: ScenarioFactory, shape_n: str, shape_next: str
) -> None:
    s = scenario_factory(any_kafka_bootstrap, partitions=2)  # records spread over both partitions (keyed)
    child = s.spawn(f"commit:1@{FIRST_POSITION}", f"commit:{SHAPES[shape_n]}", f"prepared:{NEXT[shape_next]}")
    child.expect("COMMITTED")
    state_n = PreparedTxnState(child.expect("COMMITTED"))
    prepared = PreparedTxnState(child.expect("PREPARED"))
    child.kill()

    assert state_n == s.stored_state()
    for state, shape in ((state_n, shape_n), (prepared, shape_next)):
        assert state.names_one_transaction, state
        assert state.sent_nothing is (shape == "empty")
    if (shape_n, shape_next) == ("empty", "empty"):
        # Two transactions that sent nothing have the same effect (none): equal states are harmless.
        assert state_n == prepared
    else:
        assert state_n != prepared
    if shape_next == "offsets":
        # Before recovery the group's offset is N's (N+1's commit is pending).
        assert prepared.anchor is not None and prepared.anchor[0].topic == "kafka2pc-anchors"

    producer = TwoPhaseCommitProducer(s.config)
    try:
        producer.init_transactions(keep_prepared_txn=True)
        producer.complete_transaction(state_n)
        assert producer.state is TxnState.READY
        settlement = producer.last_settlement
        assert settlement is not None
        expected = Decision.NOTHING if shape_next == "empty" else Decision.ABORT
        assert settlement.plan.decision is expected, settlement.plan
        assert not settlement.heuristic
        assert settlement.outcome is (
            TransactionOutcome.NONE if shape_n == "empty" else TransactionOutcome.COMMITTED
        ), settlement
    finally:
        producer.close()

    # N's effects stay, N+1's are gone: records, group offset, database.
    expected_rows = ["0-0"] + ([f"1-{i}" for i in range(4)] if shape_n == "records" else [])
    s.assert_consistent(expected_rows)
    expected_position = 5 if shape_n == "offsets" else FIRST_POSITION
    assert s.db_position() == expected_position
    assert s.committed_position() == expected_position
    if state_n.anchor is not None:
        assert _outcome(s.bootstrap, state_n) == "committed"
    if prepared.anchor is not None:
        assert _outcome(s.bootstrap, prepared) == "aborted"


def test_offsets_only_prepared_and_stored_is_committed_after_kill(
    any_kafka_bootstrap: str, scenario_factory: ScenarioFactory
) -> None:
    """The other half of the promise: complete(state N+1) commits the offsets-only N+1."""
    s = scenario_factory(any_kafka_bootstrap)
    child = s.spawn(f"commit:1@{FIRST_POSITION}", "stored:0@7")
    child.expect("COMMITTED")
    stored = PreparedTxnState(child.expect("STORED"))
    child.kill()
    assert stored == s.stored_state() and stored.anchor is not None

    producer = TwoPhaseCommitProducer(s.config)
    try:
        producer.init_transactions(keep_prepared_txn=True)
        producer.complete_transaction(stored)
        settlement = producer.last_settlement
        assert settlement is not None and settlement.plan.decision is Decision.COMMIT
        assert settlement.outcome is TransactionOutcome.COMMITTED
    finally:
        producer.close()
    assert s.committed_position() == s.db_position() == 7
    assert _outcome(s.bootstrap, stored) == "committed"
    s.assert_consistent(["0-0"])


def test_anchor_topic_that_cannot_be_created_is_a_clear_abortable_error(kafka_bootstrap: str) -> None:
    """The broker refuses the anchor topic (its name collides with an existing one): say what to do."""
    import uuid

    from confluent_kafka import Consumer, TopicPartition

    from kafka2pc import AbortableError
    from kafka2pc.testing import create_topic

    suffix = uuid.uuid4().hex[:8]
    create_topic(kafka_bootstrap, f"k2pc.anchor.{suffix}")  # '.' and '_' collide in Kafka's metric names
    blocked = f"k2pc_anchor_{suffix}"
    topic = create_topic(kafka_bootstrap)
    config = {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"k2pc-anchor-{suffix}",
              "kafka2pc.anchor.topic": blocked}
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"g-{suffix}"})
    with TwoPhaseCommitProducer(config) as producer:
        producer.init_transactions(10)
        producer.begin_transaction()
        producer.send_offsets_to_transaction([TopicPartition(topic, 0, 1)], consumer.consumer_group_metadata())
        with pytest.raises(AbortableError, match=f"{blocked}.*kafka2pc.anchor.topic.*could not be created"):
            producer.prepare_transaction(30)
        assert producer.state is TxnState.ABORTABLE_ERROR
        producer.abort_transaction(30)
        assert producer.state is TxnState.READY
    consumer.close()
