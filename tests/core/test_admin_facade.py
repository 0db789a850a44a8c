"""``TransactionAdmin`` as the recipes' and the CLI's recovery facade, against the real broker.

Three prepared transactions under one id family: a decision names two of
them (``settle_many`` commits the first, ``settle_open`` the second) and not
the third (a stray: ``settle_open`` aborts and fences it).  What the
``read_committed`` consumer sees must match what the facade reported.
"""

from __future__ import annotations

import logging
import uuid

import pytest

from kafka2pc import (
    Decision,
    PreparedTxnState,
    ProducerFencedError,
    Settlement,
    TopicAndPartition,
    TransactionAdmin,
    TransactionOutcome,
    TwoPhaseCommitProducer,
)
from kafka2pc.testing import create_topic, drain


def _prepared(bootstrap: str, tid: str, topic: str, value: bytes) -> tuple[TwoPhaseCommitProducer, PreparedTxnState]:
    producer = TwoPhaseCommitProducer(
        {"bootstrap.servers": bootstrap, "transactional.id": tid, "transaction.timeout.ms": 120_000}
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, value=value)
    return producer, producer.prepare_transaction(30)


def test_settle_many_settle_open_and_outcomes_agree_with_the_consumer(kafka_bootstrap: str) -> None:
    topic = create_topic(kafka_bootstrap, partitions=3)
    base = f"k2pc-facade-{uuid.uuid4().hex[:8]}"
    first, first_state = _prepared(kafka_bootstrap, f"{base}-0", topic, b"first")
    second, second_state = _prepared(kafka_bootstrap, f"{base}-1", topic, b"second")
    stray, stray_state = _prepared(kafka_bootstrap, f"{base}-2", topic, b"stray")
    seen: list[tuple[str, Settlement]] = []
    try:
        with TransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:
            assert topic in admin.topic_names()
            limit = admin.max_transaction_timeout_s()
            assert limit is not None and 0 < limit <= 2_147_483.648

            settled = admin.settle_many({f"{base}-0": first_state}, fence=False,
                                        on_settled=lambda t, s: seen.append((t, s)))
            assert [t for t, _ in seen] == [f"{base}-0"]
            assert settled[f"{base}-0"].outcome is TransactionOutcome.COMMITTED
            info = admin.describe_transaction(f"{base}-0")
            assert info is not None and info.state == "CompleteCommit"  # the markers were waited for, no fence

            decisions = admin.settle_open(lambda tid: tid.startswith(base + "-"), {f"{base}-1": second_state})
            assert decisions == {f"{base}-1": Decision.COMMIT, f"{base}-2": Decision.ABORT}
            assert admin.settle_open(lambda tid: tid.startswith(base + "-"), {}) == {}  # nothing open any more

            outcomes = admin.outcomes_of_settled(
                {"first": first_state, "second": second_state, "stray": stray_state}, wait_s=5
            )
            assert outcomes == {"first": TransactionOutcome.COMMITTED, "second": TransactionOutcome.COMMITTED,
                                "stray": TransactionOutcome.ABORTED}
            assert admin.transaction_outcome(f"{base}-2", stray_state, settled=True) is TransactionOutcome.ABORTED
            assert admin.transaction_outcome(f"{base}-2", stray_state) is TransactionOutcome.ABORTED

            anchor = stray_state.anchor
            assert anchor is not None
            partition = TopicAndPartition(topic, anchor[0].partition)
            lag = admin.partition_lag(partition)
            assert lag.held_back == 0  # nothing left open on the partition
            assert all(p.current_txn_start_offset == -1 for p in admin.describe_producers(partition))
            assert admin.find_hanging_transactions([partition], max_transaction_timeout_s=0) == []
    finally:
        for producer in (first, second):
            producer.close(5)
    try:
        stray.commit_transaction(10)  # fenced by settle_open's abort
        raise AssertionError("the stray's producer was not fenced")
    except ProducerFencedError:
        pass
    finally:
        stray.close(5)
    values = sorted(r.value for r in drain(kafka_bootstrap, topic, "read_committed") if r.value != b"")
    assert values == [b"first", b"second"]


def test_force_terminate_warns_only_when_it_ended_an_open_transaction(
    kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A routine fence of an id with nothing open is one INFO line; WARNING is for an Ongoing one aborted."""
    topic = create_topic(kafka_bootstrap)
    tid = f"k2pc-fence-log-{uuid.uuid4().hex[:8]}"
    producer = TwoPhaseCommitProducer({"bootstrap.servers": kafka_bootstrap, "transactional.id": tid})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"open")
    producer.flush(30)
    with TransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin, \
            caplog.at_level(logging.INFO, logger="kafka2pc._admin"):
        before = admin.force_terminate_transaction(tid)
        assert before is not None and before.state == "Ongoing"
        ended = [r for r in caplog.records if r.name == "kafka2pc._admin"]
        assert [r.levelno for r in ended] == [logging.WARNING] and "aborted its open transaction" in ended[0].message
        caplog.clear()
        again = admin.force_terminate_transaction(tid, timeout=30)
        assert again is not None and again.state != "Ongoing"
        routine = [r for r in caplog.records if r.name == "kafka2pc._admin"]
        assert [r.levelno for r in routine] == [logging.INFO] and "nothing was open" in routine[0].message
    producer.close()
    assert drain(kafka_bootstrap, topic, "read_committed") == []


@pytest.mark.parametrize("call", ["complete_transaction", "settle_many"])
def test_one_fence_default_fences_the_old_producer(kafka_bootstrap: str, call: str) -> None:
    """``fence=True`` is the default of both settling calls: the old instance's next call is fenced."""
    topic = create_topic(kafka_bootstrap)
    tid = f"k2pc-fence-default-{uuid.uuid4().hex[:8]}"
    old, state = _prepared(kafka_bootstrap, tid, topic, b"fenced")
    try:
        with TransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:
            before = admin.describe_transaction(tid)
            assert before is not None
            if call == "complete_transaction":
                settlement = admin.complete_transaction(tid, state)
            else:
                settlement = admin.settle_many({tid: state})[tid]
            assert settlement.outcome is TransactionOutcome.COMMITTED
            after = admin.describe_transaction(tid)
            assert after is not None and after.description.producer_epoch > before.description.producer_epoch
    finally:
        old.close(timeout=5)
    assert [r.value for r in drain(kafka_bootstrap, topic)] == [b"fenced"]
