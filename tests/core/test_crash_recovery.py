"""Crash recovery against real brokers: a dual-writing child is ``kill -9``-ed at a known step.

Each test runs a child process (``_child.py``) that writes SQLite rows and
Kafka records with KIP-939's recipe, kills it with SIGKILL (or freezes it with
SIGSTOP) at the step under test, runs the recovery routine — read the stored
state, ``init_transactions(keep_prepared_txn=True)``,
``complete_transaction(state)`` — and checks the real end state: every
database row has exactly one ``read_committed`` record and vice versa, and
nothing is left hanging (last stable offset == high watermark).

The main scenarios run on every broker line of CI's matrix (``any_kafka_bootstrap``:
4.4.0, 4.3.1 and 3.9.2).
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest
from harness.scenario import Scenario

from kafka2pc import (
    Decision,
    IllegalStateError,
    PreparedTxnState,
    TransactionAdmin,
    TransactionalIdMismatchError,
    TransactionOutcome,
    TwoPhaseCommitProducer,
    TxnState,
)

ScenarioFactory = Callable[..., Scenario]


def recover(scenario: Scenario, state: PreparedTxnState | None = None) -> TwoPhaseCommitProducer:
    """The recovery routine of a restarted application: stored state -> complete_transaction."""
    producer = TwoPhaseCommitProducer(scenario.config)
    producer.init_transactions(keep_prepared_txn=True)
    assert producer.state is TxnState.RECOVERING
    producer.complete_transaction(scenario.stored_state() if state is None else state)
    assert producer.state is TxnState.READY
    return producer


def values(txn: int, count: int, start: int = 0) -> list[str]:
    return [f"{txn}-{i}" for i in range(start, start + count)]


# -- (a) prepared and stored: commit ----------------------------------------------


def test_prepared_and_stored_is_committed_after_kill(
    any_kafka_bootstrap: str, scenario_factory: ScenarioFactory
) -> None:
    s = scenario_factory(any_kafka_bootstrap, partitions=2)
    child = s.spawn("commit:2", "stored:3")
    child.expect("COMMITTED")
    stored_text = child.expect("STORED")
    child.kill()
    s.assert_hanging()
    assert s.visible() == values(0, 2)  # the prepared records are invisible until recovery

    state = s.stored_state()
    assert str(state) == stored_text and state.anchor is not None
    producer = recover(s)
    settlement = producer.last_settlement
    assert settlement is not None
    assert settlement.plan.decision is Decision.COMMIT
    assert settlement.outcome is TransactionOutcome.COMMITTED and not settlement.heuristic
    s.assert_consistent(values(0, 2) + values(1, 3))

    # The recovered producer is an ordinary producer again.
    producer.begin_transaction()
    producer.produce(s.topic, value=b"after-recovery")
    producer.prepare_transaction(30)
    producer.commit_transaction(30)
    assert s.visible() == sorted(values(0, 2) + values(1, 3) + ["after-recovery"])
    producer.close()


# -- (b) prepared or open, nothing stored: abort -------------------------------------


@pytest.mark.parametrize("last_step", ["prepared:3", "open:3"])
def test_nothing_stored_is_aborted_after_kill(
    kafka_bootstrap: str, scenario_factory: ScenarioFactory, last_step: str
) -> None:
    s = scenario_factory(kafka_bootstrap)
    child = s.spawn(last_step)
    child.expect("PREPARED" if last_step.startswith("prepared") else "OPEN")
    child.kill()
    s.assert_hanging()
    assert s.stored_state() == PreparedTxnState()  # the database never recorded a decision

    producer = recover(s)
    settlement = producer.last_settlement
    assert settlement is not None
    assert settlement.plan.decision is Decision.ABORT
    assert settlement.outcome is TransactionOutcome.NONE and not settlement.heuristic
    assert s.assert_consistent([]) == []
    producer.close()


# -- (c) N committed and stored, N+1 prepared: abort N+1 ----------------------------------


def test_transaction_n_plus_1_is_aborted_when_the_database_kept_n(
    any_kafka_bootstrap: str, scenario_factory: ScenarioFactory
) -> None:
    """librdkafka reuses producerId:epoch, so only the anchor tells N from N+1."""
    s = scenario_factory(any_kafka_bootstrap)
    child = s.spawn("commit:2", "prepared:3")
    state_n = PreparedTxnState(child.expect("COMMITTED"))
    state_n1 = PreparedTxnState(child.expect("PREPARED"))
    child.kill()
    assert (state_n.producer_id, state_n.epoch) == (state_n1.producer_id, state_n1.epoch)
    assert state_n != state_n1
    assert s.stored_state() == state_n

    with TransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
        plan = admin.plan_recovery(s.transactional_id, state_n)
    assert plan.decision is Decision.ABORT
    assert plan.stored_outcome is TransactionOutcome.COMMITTED and not plan.heuristic
    s.assert_hanging()  # planning changed nothing

    producer = recover(s)
    settlement = producer.last_settlement
    assert settlement is not None
    assert settlement.plan.decision is Decision.ABORT
    assert settlement.outcome is TransactionOutcome.COMMITTED
    s.assert_consistent(values(0, 2))
    producer.close()


# -- (d) complete twice, from processes that never produced -----------------------------


def test_completing_twice_is_harmless(kafka_bootstrap: str, scenario_factory: ScenarioFactory) -> None:
    s = scenario_factory(kafka_bootstrap)
    child = s.spawn("stored:3")
    child.expect("STORED")
    child.kill()
    state = s.stored_state()

    with TransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
        assert admin.transaction_outcome(s.transactional_id, state) is TransactionOutcome.ONGOING
        first = admin.complete_transaction(s.transactional_id, state)
        assert first.plan.decision is Decision.COMMIT and first.outcome is TransactionOutcome.COMMITTED
        again = admin.complete_transaction(s.transactional_id, state)
        assert again.plan.decision is Decision.NOTHING and again.outcome is TransactionOutcome.COMMITTED
        assert admin.transaction_outcome(s.transactional_id, state) is TransactionOutcome.COMMITTED
    s.assert_consistent(values(0, 3))

    # A fresh producer completing the same state again: nothing to do, still committed.
    producer = recover(s, state)
    settlement = producer.last_settlement
    assert settlement is not None
    assert settlement.plan.decision is Decision.NOTHING
    assert settlement.outcome is TransactionOutcome.COMMITTED
    with pytest.raises(IllegalStateError):
        producer.complete_transaction(state)  # READY: completion is a recovery-time call
    producer.close()
    s.assert_consistent(values(0, 3))


# -- (e) the old instance is fenced after recovery ------------------------------------------


def test_frozen_prepared_instance_is_fenced_after_recovery(
    kafka_bootstrap: str, scenario_factory: ScenarioFactory
) -> None:
    s = scenario_factory(kafka_bootstrap)
    child = s.spawn("stored:3")
    child.expect("STORED")
    child.expect("READY")
    child.signal(signal.SIGSTOP)  # a long GC pause: the application presumes it dead
    producer = recover(s)
    child.signal(signal.SIGCONT)

    child.send("commit")
    assert child.expect("ERROR").startswith("ProducerFencedError")
    child.send("produce:2")
    assert child.expect("ERROR").startswith("IllegalStateError")  # fatal: the instance is done
    child.kill()
    s.assert_consistent(values(0, 3))
    producer.close()


def test_frozen_open_instance_cannot_make_anything_visible(
    kafka_bootstrap: str, scenario_factory: ScenarioFactory
) -> None:
    s = scenario_factory(kafka_bootstrap)
    child = s.spawn("commit:2", "open:2")
    child.expect("COMMITTED")
    child.expect("OPEN")
    child.expect("READY")
    child.signal(signal.SIGSTOP)
    producer = recover(s)  # the stored state is N's: the open transaction is aborted
    assert producer.last_settlement is not None
    assert producer.last_settlement.plan.decision is Decision.ABORT
    child.signal(signal.SIGCONT)

    child.send("produce:3")  # produce + flush on a fenced epoch: the partition leader refuses them
    assert child.expect("ERROR").startswith("ProducerFencedError")
    child.send("prepare")
    assert child.expect("ERROR").startswith("IllegalStateError")  # fatal: the instance is done
    child.send("commit")
    assert child.expect("ERROR").startswith("IllegalStateError")
    child.kill()
    s.assert_consistent(values(0, 2))
    producer.close()


# -- misuse ----------------------------------------------------------------------------


def test_state_of_another_transactional_id_is_refused_and_changes_nothing(
    kafka_bootstrap: str, scenario_factory: ScenarioFactory
) -> None:
    s = scenario_factory(kafka_bootstrap)
    other = scenario_factory(kafka_bootstrap)
    child = s.spawn("stored:3")
    child.expect("STORED")
    child.kill()
    state = s.stored_state()

    producer = TwoPhaseCommitProducer(other.config)
    producer.init_transactions(keep_prepared_txn=True)
    with pytest.raises(TransactionalIdMismatchError, match=other.transactional_id):
        producer.complete_transaction(state)
    assert producer.state is TxnState.RECOVERING
    with TransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
        with pytest.raises(TransactionalIdMismatchError):
            admin.complete_transaction(other.transactional_id, state)
        with pytest.raises(TransactionalIdMismatchError):
            admin.plan_recovery(other.transactional_id, state)
    producer.close()
    s.assert_hanging()  # s's prepared transaction was not touched
    recover(s).close()
    s.assert_consistent(values(0, 3))


# -- KIP-939: after init_transactions(keep_prepared_txn=True), commit/abort settle what is open ----


@pytest.mark.parametrize("decision", ["commit", "abort"])
def test_commit_or_abort_settles_the_transaction_left_open(
    kafka_bootstrap: str, scenario_factory: ScenarioFactory, decision: str
) -> None:
    s = scenario_factory(kafka_bootstrap)
    child = s.spawn("stored:3")
    child.expect("STORED")
    child.kill()
    producer = TwoPhaseCommitProducer(s.config)
    producer.init_transactions(keep_prepared_txn=True)
    for refused in (producer.begin_transaction, producer.prepare_transaction):
        with pytest.raises(IllegalStateError, match="keep_prepared_txn"):
            refused()
    (producer.commit_transaction if decision == "commit" else producer.abort_transaction)()
    assert producer.state is TxnState.READY
    if decision == "commit":
        s.assert_consistent(values(0, 3))
    else:
        assert s.visible() == [] and s.db_values() == values(0, 3)  # the caller chose to diverge
    producer.close()
