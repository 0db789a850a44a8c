"""Heuristic outcome: Kafka aborted a prepared transaction that the database committed.

librdkafka cannot open 2PC transactions (no ``Enable2Pc``), so the broker aborts
a prepared transaction once ``transaction.timeout.ms`` has passed.  When the
database committed that transaction's state, recovery must say so loudly
(:class:`HeuristicOutcomeError`) and never report success.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from harness.scenario import Scenario

from kafka2pc import (
    Decision,
    HeuristicOutcomeError,
    TransactionAdmin,
    TransactionOutcome,
    TwoPhaseCommitProducer,
    TxnState,
)
from kafka2pc.testing import end_offsets


def test_prepared_transaction_aborted_by_its_timeout_is_a_heuristic_outcome(
    kafka_bootstrap: str, scenario_factory: Callable[..., Scenario]
) -> None:
    s = scenario_factory(kafka_bootstrap)
    child = s.spawn("commit:1", "stored:3", timeout_ms=3000)
    child.expect("COMMITTED")
    child.expect("STORED")
    child.kill()
    state = s.stored_state()

    with TransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
        # The coordinator looks for expired transactions every second (the test broker's setting).
        deadline = time.monotonic() + 40
        while (info := admin.describe_transaction(s.transactional_id)) is not None and info.is_open:
            assert time.monotonic() < deadline, "the broker did not abort the expired transaction"
            time.sleep(0.5)
        assert info is not None and info.state == "CompleteAbort"
        assert admin.transaction_outcome(s.transactional_id, state) is TransactionOutcome.ABORTED
        plan = admin.plan_recovery(s.transactional_id, state)
        assert plan.decision is Decision.NOTHING and plan.heuristic
        assert "HEURISTIC" in plan.reason

    producer = TwoPhaseCommitProducer(s.config)
    producer.init_transactions(keep_prepared_txn=True)
    with pytest.raises(HeuristicOutcomeError) as raised:
        producer.complete_transaction(state)
    error = raised.value
    assert error.outcome == "aborted"
    assert error.transactional_id == s.transactional_id
    assert error.state == state
    # The outcome is settled (Kafka aborted): the producer moves on, fenced and ready.
    assert producer.state is TxnState.READY

    # The divergence is real and reported, not hidden: the database has rows Kafka does not.
    assert s.db_values() == ["0-0", "1-0", "1-1", "1-2"]
    assert s.visible() == ["0-0"]
    assert end_offsets(s.bootstrap, s.topic, "read_committed") == end_offsets(s.bootstrap, s.topic, "read_uncommitted")

    # Every later attempt reports the same outcome; on_heuristic="report" returns it instead.
    with TransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
        with pytest.raises(HeuristicOutcomeError):
            admin.complete_transaction(s.transactional_id, state)
        settlement = admin.complete_transaction(s.transactional_id, state, on_heuristic="report")
    assert settlement.heuristic and settlement.outcome is TransactionOutcome.ABORTED
    producer.close()
