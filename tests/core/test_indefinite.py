"""Indefinite outcomes: a commit or EndTxn that got no answer, on a broker that really stops answering.

The shared broker must not be disturbed, so this module starts a private
one-node broker (``harness.ports``), freezes its JVM with SIGSTOP for a few
seconds while a commit is in flight, and wipes it afterwards.  Nothing here
patches the client libraries: the timeouts are the real ones.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from harness.brokers import frozen
from harness.ports import private_broker

from kafka2pc import (
    IllegalStateError,
    IndefiniteOutcomeError,
    RetriableError,
    TransactionAdmin,
    TransactionOutcome,
    TwoPhaseCommitProducer,
    TxnState,
)
from kafka2pc._control import ControlPlane
from kafka2pc.testing import create_topic, drain, end_offsets
from kafka2pc.testing.broker import LocalKafka


@pytest.fixture(scope="module")
def private_kafka() -> Iterator[LocalKafka]:
    """A one-node broker only this module uses (it gets frozen); wiped afterwards."""
    with private_broker("core/test_indefinite") as kafka:
        yield kafka


def visible(bootstrap: str, topic: str) -> list[bytes]:
    return sorted(r.value or b"" for r in drain(bootstrap, topic, "read_committed"))


def settled(bootstrap: str, topic: str) -> bool:
    return end_offsets(bootstrap, topic, "read_committed") == end_offsets(bootstrap, topic, "read_uncommitted")


def test_commit_timeout_is_in_doubt_until_completed(private_kafka: LocalKafka) -> None:
    bootstrap = private_kafka.bootstrap_servers
    topic = create_topic(bootstrap)
    config = {"bootstrap.servers": bootstrap, "transactional.id": f"k2pc-indef-{uuid.uuid4().hex[:8]}"}
    control = ControlPlane(config, request_timeout_s=2, max_retries=1)
    producer = TwoPhaseCommitProducer(config, control_plane=control)
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(3):
        producer.produce(topic, value=b"r%d" % i)
    state = producer.prepare_transaction(30)

    with frozen(private_kafka):
        with pytest.raises(IndefiniteOutcomeError) as raised:
            producer.commit_transaction(2)
        assert raised.value.state == state
        assert producer.state is TxnState.IN_DOUBT
        # Nothing new may start, nor the opposite decision, before the outcome is known (KAFKA-17754).
        for refused in (producer.begin_transaction, producer.abort_transaction, producer.prepare_transaction):
            with pytest.raises(IllegalStateError, match="outcome of commit_transaction"):
                refused()
        with pytest.raises(IllegalStateError):
            producer.produce(topic, value=b"late")
        # Completing while the broker is still silent fails, and must leave the transaction in doubt:
        # it must neither report success nor abort the prepared transaction by re-initialising.
        with pytest.raises((IndefiniteOutcomeError, RetriableError)):
            producer.complete_transaction(state)
        assert producer.state is TxnState.IN_DOUBT

    # The broker is back: complete, retrying transient errors as an application would.
    for attempt in range(20):
        try:
            producer.complete_transaction(state)
            break
        except RetriableError:
            assert producer.state is TxnState.IN_DOUBT and attempt < 19
            time.sleep(0.5)
    assert producer.state is TxnState.READY
    assert producer.last_settlement is not None
    assert producer.last_settlement.outcome is TransactionOutcome.COMMITTED
    assert visible(bootstrap, topic) == [b"r0", b"r1", b"r2"]
    assert settled(bootstrap, topic)

    # The producer works normally afterwards.
    producer.begin_transaction()
    producer.produce(topic, value=b"next")
    producer.prepare_transaction(30)
    producer.commit_transaction(30)
    assert visible(bootstrap, topic) == [b"next", b"r0", b"r1", b"r2"]
    producer.close()
    control.close()


def test_end_txn_without_answer_is_indefinite_then_settled(private_kafka: LocalKafka) -> None:
    """The coordinator-direct path: an EndTxn lost in a frozen broker may or may not land."""
    bootstrap = private_kafka.bootstrap_servers
    topic = create_topic(bootstrap)
    tid = f"k2pc-indef-{uuid.uuid4().hex[:8]}"
    producer = TwoPhaseCommitProducer({"bootstrap.servers": bootstrap, "transactional.id": tid})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"x")
    state = producer.prepare_transaction(30)
    producer._calls.release()  # noqa: SLF001 - abandon the instance as a crash would (no abort)

    with ControlPlane({"bootstrap.servers": bootstrap}, request_timeout_s=2, max_retries=0) as control:
        description = control.describe_transaction(tid)
        assert description is not None and description.state == "Ongoing"
        with frozen(private_kafka):
            started = time.monotonic()
            with pytest.raises(IndefiniteOutcomeError) as raised:
                control.end_txn(tid, description.producer_id, description.producer_epoch, commit=True)
            assert time.monotonic() - started < 10  # bounded by the request timeout
        assert raised.value.state == (description.producer_id, description.producer_epoch)

    # Whether or not the lost EndTxn landed after the broker woke up, completing settles it.
    with TransactionAdmin({"bootstrap.servers": bootstrap}) as admin:
        settlement = admin.complete_transaction(tid, state)
        assert settlement.outcome is TransactionOutcome.COMMITTED
        assert admin.complete_transaction(tid, state).outcome is TransactionOutcome.COMMITTED
    assert visible(bootstrap, topic) == [b"x"]
    assert settled(bootstrap, topic)
