"""Producer calls end within the caller's timeout plus ``TIMEOUT_SLACK_S``: unreachable cluster, broker stopped.

The unreachable bootstrap is a closed port in this session's port block; the
stopped broker is a private one-node cluster (``LocalKafka`` on its own ports)
that the test stops mid-transaction.  Time-to-error is asserted, not just the
error class.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from harness import ports

from kafka2pc import (
    BrokerUnavailableError,
    IndefiniteOutcomeError,
    RetriableError,
    TwoPhaseCommitProducer,
    TxnState,
)
from kafka2pc._deadline import DEFAULT_TIMEOUT_S, TIMEOUT_SLACK_S
from kafka2pc.testing import create_topic
from kafka2pc.testing.broker import LocalKafka

TIMEOUT = 3.0


def closed_port() -> str:
    return f"127.0.0.1:{ports.closed_port()}"  # nothing listens there


def test_default_bound_is_finite_and_below_the_transaction_timeout() -> None:
    assert 0 < DEFAULT_TIMEOUT_S <= 120 and 0 < TIMEOUT_SLACK_S <= 2


@pytest.mark.parametrize("keep_prepared_txn", [False, True])
def test_init_transactions_against_an_unreachable_cluster_ends_within_its_timeout(keep_prepared_txn: bool) -> None:
    producer = TwoPhaseCommitProducer({"bootstrap.servers": closed_port(), "transactional.id": "k2pc-unreachable"})
    start = time.monotonic()
    with pytest.raises(BrokerUnavailableError):
        producer.init_transactions(TIMEOUT, keep_prepared_txn=keep_prepared_txn)
    elapsed = time.monotonic() - start
    print(f"time-to-error {elapsed:.2f}s")  # reported with -s
    assert elapsed <= TIMEOUT + TIMEOUT_SLACK_S, elapsed
    assert producer.state is TxnState.UNINITIALIZED
    producer.close()


@pytest.fixture(scope="module")
def private_kafka() -> Iterator[LocalKafka]:
    with ports.private_broker("core/test_producer_timeouts") as kafka:
        yield kafka


@pytest.fixture
def started(private_kafka: LocalKafka) -> LocalKafka:
    if not private_kafka.running():
        private_kafka.start()
    return private_kafka


def _producer(kafka: LocalKafka) -> tuple[TwoPhaseCommitProducer, str]:
    topic = create_topic(kafka.bootstrap_servers)
    producer = TwoPhaseCommitProducer(
        {"bootstrap.servers": kafka.bootstrap_servers, "transactional.id": f"k2pc-down-{uuid.uuid4().hex[:8]}"}
    )
    producer.init_transactions(30)
    return producer, topic


def test_prepare_with_the_broker_stopped_ends_within_its_timeout(started: LocalKafka) -> None:
    producer, topic = _producer(started)
    producer.begin_transaction()
    producer.produce(topic, value=b"before")
    producer.flush(30)
    started.stop(kill=True)
    producer.produce(topic, value=b"after")
    start = time.monotonic()
    with pytest.raises(RetriableError):
        producer.prepare_transaction(TIMEOUT)
    elapsed = time.monotonic() - start
    print(f"time-to-error {elapsed:.2f}s")  # reported with -s
    assert elapsed <= TIMEOUT + TIMEOUT_SLACK_S, elapsed
    assert producer.state is TxnState.IN_TRANSACTION  # call again, or abort
    producer.close(0)


def test_commit_with_the_broker_stopped_ends_within_its_timeout(started: LocalKafka) -> None:
    producer, topic = _producer(started)
    producer.begin_transaction()
    producer.produce(topic, value=b"x")
    producer.prepare_transaction(30)
    started.stop(kill=True)
    start = time.monotonic()
    with pytest.raises(IndefiniteOutcomeError):
        producer.commit_transaction(TIMEOUT)
    elapsed = time.monotonic() - start
    print(f"time-to-error {elapsed:.2f}s")  # reported with -s
    assert elapsed <= TIMEOUT + TIMEOUT_SLACK_S, elapsed
    assert producer.state is TxnState.IN_DOUBT
    producer.close(0)


def test_complete_transaction_in_recovery_with_the_broker_stopped_ends_within_its_timeout(
    started: LocalKafka,
) -> None:
    """A restarted process settling a stored state while the broker is down: the settlement and the
    re-initialisation share the caller's ``timeout``; the prepared transaction is left as it was."""
    producer, topic = _producer(started)
    producer.begin_transaction()
    producer.produce(topic, value=b"x")
    state = producer.prepare_transaction(30)
    producer.close(0)
    restarted = TwoPhaseCommitProducer(
        {"bootstrap.servers": started.bootstrap_servers, "transactional.id": producer.transactional_id}
    )
    restarted.init_transactions(30, keep_prepared_txn=True)
    started.stop(kill=True)
    start = time.monotonic()
    with pytest.raises((BrokerUnavailableError, IndefiniteOutcomeError)):
        restarted.complete_transaction(state, TIMEOUT)
    elapsed = time.monotonic() - start
    print(f"time-to-error {elapsed:.2f}s")  # reported with -s
    assert elapsed <= TIMEOUT + TIMEOUT_SLACK_S, elapsed
    assert restarted.state in (TxnState.RECOVERING, TxnState.IN_DOUBT)  # nothing decided: call it again
    started.start()
    restarted.complete_transaction(state, 60)
    assert restarted.last_settlement is not None
    assert restarted.last_settlement.outcome.value == "committed"
    restarted.close(0)
