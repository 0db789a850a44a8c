"""The control plane and ``TransactionAdmin`` finish within the caller's timeout.

Three ways a cluster fails to answer, each against real sockets:

* unreachable bootstrap: a closed port in this checkout's port block;
* a broker that stops answering with connections open (SIGSTOP: the kernel
  still accepts, nobody reads) -- the worst case for a client's timeouts;
* a broker that is gone (SIGKILL: connections refused) after the client
  had connected.

The broken brokers are a private one-node cluster this module starts and
wipes; the shared session broker is never disturbed.  Each test asserts that
the call raises a kafka2pc error within ``timeout + SLACK_S`` and prints the
measured time-to-error.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import suppress
from typing import Any

import pytest
from harness.brokers import frozen
from harness.ports import closed_port, private_broker

from kafka2pc import (
    BrokerUnavailableError,
    IndefiniteOutcomeError,
    KafkaTransactionError,
    PreparedTxnState,
    TransactionAdmin,
    TransactionOutcome,
    TwoPhaseCommitProducer,
)
from kafka2pc._control import DEFAULT_CONTROL_TIMEOUT_S, ControlPlane
from kafka2pc._types import TopicPartition
from kafka2pc.aio import AsyncTransactionAdmin
from kafka2pc.testing import create_topic
from kafka2pc.testing.broker import LocalKafka

SLACK_S = 1.5
"""The documented slack: a call given ``timeout`` raises by ``timeout + SLACK_S``."""


def bounded(
    timeout_s: float,
    call: Callable[[], Any],
    expected: type[BaseException] | tuple[type[BaseException], ...] = KafkaTransactionError,
) -> float:
    """Run ``call``; assert it raises ``expected`` within ``timeout_s + SLACK_S``; the time it took."""
    start = time.monotonic()
    with pytest.raises(expected) as info:
        result = call()
        pytest.fail(f"returned {result!r} after {time.monotonic() - start:.2f} s instead of raising {expected}")
    elapsed = time.monotonic() - start
    print(f"\n  time-to-error {elapsed:.2f} s (timeout {timeout_s:g} s): {type(info.value).__name__}: {info.value}")
    assert elapsed <= timeout_s + SLACK_S, f"took {elapsed:.2f} s for a {timeout_s} s timeout: {info.value}"
    return elapsed


# -- unreachable bootstrap ------------------------------------------------------


@pytest.fixture(scope="module")
def unreachable() -> dict[str, str]:
    return {"bootstrap.servers": f"127.0.0.1:{closed_port()}"}


def test_defaults_are_finite_and_documented() -> None:
    admin = TransactionAdmin({"bootstrap.servers": "127.0.0.1:1"})
    assert admin.timeout_s == DEFAULT_CONTROL_TIMEOUT_S == 30.0
    assert ControlPlane({"bootstrap.servers": "127.0.0.1:1"}).timeout_s == DEFAULT_CONTROL_TIMEOUT_S
    assert TransactionAdmin({"bootstrap.servers": "127.0.0.1:1"}, request_timeout_s=7).timeout_s == DEFAULT_CONTROL_TIMEOUT_S
    assert TransactionAdmin({"bootstrap.servers": "127.0.0.1:1"}, timeout_s=4).timeout_s == 4


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda cp, t: cp.describe_transaction("tx", timeout=t), id="describe_transaction"),
        pytest.param(lambda cp, t: cp.end_txn("tx", 1, 0, commit=True, timeout=t), id="end_txn"),
        pytest.param(lambda cp, t: cp.init_producer_id("tx", transaction_timeout_ms=1000, timeout=t),
                     id="init_producer_id"),
        pytest.param(lambda cp, t: cp.list_transactions(timeout=t), id="list_transactions"),
        pytest.param(lambda cp, t: cp.api_versions(timeout=t), id="api_versions"),
        pytest.param(lambda cp, t: cp.record_outcome(TopicPartition("t", 0), 5, timeout=t), id="record_outcome"),
    ],
)
def test_control_plane_call_against_unreachable_bootstrap(
    unreachable: dict[str, str], call: Callable[[ControlPlane, float], object]
) -> None:
    with ControlPlane(unreachable) as cp:  # default timeout_s is 30 s: the call's own timeout must win
        bounded(2.0, lambda: call(cp, 2.0), BrokerUnavailableError)


def test_control_plane_default_timeout_against_unreachable_bootstrap(unreachable: dict[str, str]) -> None:
    with ControlPlane(unreachable, timeout_s=2.5) as cp:
        bounded(2.5, lambda: cp.describe_transaction("tx"), BrokerUnavailableError)


def test_request_timeout_bounds_connecting(unreachable: dict[str, str]) -> None:
    # The CLI's --timeout: an unreachable cluster is reported after it, not after the 30 s call bound.
    with TransactionAdmin(unreachable, request_timeout_s=2) as admin:
        bounded(2.0, admin.list_transactions, BrokerUnavailableError)


def test_deadline_block_bounds_several_calls(unreachable: dict[str, str]) -> None:
    with ControlPlane(unreachable) as cp:
        def two_calls() -> None:
            with cp.deadline(2.0):
                with suppress(BrokerUnavailableError):
                    cp.describe_transaction("tx")
                cp.describe_transaction("tx", timeout=20)  # cannot outlive the block
        bounded(2.0, two_calls, BrokerUnavailableError)


def test_failed_connects_leave_no_client_thread_behind(unreachable: dict[str, str]) -> None:
    before = {t.ident for t in threading.enumerate()}
    with ControlPlane(unreachable) as cp:
        for _ in range(3):
            bounded(0.5, lambda: cp.describe_transaction("tx", timeout=0.5), BrokerUnavailableError)
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not left, f"threads left behind by failed connects: {left}"


def test_transaction_admin_against_unreachable_bootstrap(unreachable: dict[str, str]) -> None:
    with TransactionAdmin(unreachable, timeout_s=3) as admin:
        bounded(3.0, admin.list_transactions, BrokerUnavailableError)
        bounded(3.0, lambda: admin.describe_transaction("tx"), BrokerUnavailableError)
    state = PreparedTxnState("7:0")
    with TransactionAdmin(unreachable) as admin:  # 30 s default; each call's timeout wins
        bounded(2.0, lambda: admin.force_terminate_transaction("tx", timeout=2), BrokerUnavailableError)
        bounded(2.0, lambda: admin.complete_transaction("tx", state, timeout=2), BrokerUnavailableError)
        bounded(2.0, lambda: admin.plan_recovery("tx", state, timeout=2), BrokerUnavailableError)
        bounded(2.0, lambda: admin.transaction_outcome("tx", state, timeout=2), BrokerUnavailableError)


def test_transaction_admin_facade_methods_against_unreachable_bootstrap(unreachable: dict[str, str]) -> None:
    """The methods the recipes and the CLI use: each ends within its timeout (per transaction where
    it settles several, plus ``wait_s`` where it asks again)."""
    state = PreparedTxnState("k2pc1:7:0:1b5b9ccb:0:5:t")  # anchored on t-0@5, id "tx"
    tp = TopicPartition("t", 0)
    with TransactionAdmin(unreachable) as admin:
        bounded(1.0, lambda: admin.outcome_of(state, timeout=1), BrokerUnavailableError)
        bounded(1.5, lambda: admin.outcomes_of_settled({"tx": state}, wait_s=0.5, timeout=1), BrokerUnavailableError)
        bounded(1.0, lambda: admin.settle_many({"tx": state}, timeout=1), BrokerUnavailableError)
        bounded(1.0, lambda: admin.settle_open(lambda tid: True, {}, timeout=1), BrokerUnavailableError)
        bounded(1.0, lambda: admin.describe_producers(tp, timeout=1), BrokerUnavailableError)
        bounded(1.0, lambda: admin.partition_lag(tp, timeout=1), BrokerUnavailableError)
        bounded(1.0, lambda: admin.find_hanging_transactions([tp], timeout=1), BrokerUnavailableError)
        bounded(1.0, lambda: admin.abort_partition_transaction(tp, 7, 0, timeout=1), BrokerUnavailableError)
        bounded(1.0, lambda: admin.topic_names(timeout=1), BrokerUnavailableError)
        bounded(1.0, lambda: admin.max_transaction_timeout_ms(timeout=1), BrokerUnavailableError)
        bounded(1.0, lambda: admin.partitions(topic="t", timeout=1), KafkaTransactionError)


# -- a broker that stops answering, or dies, after the client connected ---------------


@pytest.fixture(scope="module")
def private_kafka() -> Iterator[LocalKafka]:
    """A one-node broker only this module uses (it gets frozen and killed); wiped afterwards."""
    with private_broker("control/test_timeouts") as kafka:
        yield kafka


def prepared_transaction(kafka: LocalKafka) -> tuple[str, Any, TwoPhaseCommitProducer]:
    """A prepared (flushed, not committed) transaction: its id, state and producer.

    The broker is first waited for: after an earlier test froze or killed it, its controller may still
    count it fenced (its heartbeats stopped), and a topic cannot be created until it is back.
    """
    kafka.wait_ready(timeout=90)
    bootstrap = kafka.bootstrap_servers
    topic = f"timeouts-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic)
    txid = f"timeouts-tx-{uuid.uuid4().hex[:8]}"
    producer = TwoPhaseCommitProducer(
        {"bootstrap.servers": bootstrap, "transactional.id": txid, "transaction.timeout.ms": 120_000}
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, b"prepared")
    state = producer.prepare_transaction(30)
    return txid, state, producer


def test_unanswering_broker_bounds_every_admin_call(private_kafka: LocalKafka) -> None:
    bootstrap = private_kafka.bootstrap_servers
    txid, state, producer = prepared_transaction(private_kafka)
    try:
        with TransactionAdmin({"bootstrap.servers": bootstrap}) as admin:
            assert admin.describe_transaction(txid) is not None  # connected, coordinator known
            async_admin = AsyncTransactionAdmin({"bootstrap.servers": bootstrap})
            assert asyncio.run(async_admin.describe_transaction(txid)) is not None
            with frozen(private_kafka):
                bounded(3.0, lambda: admin.describe_transaction(txid, timeout=3), BrokerUnavailableError)
                bounded(3.0, lambda: admin.list_transactions(timeout=3), BrokerUnavailableError)
                # the asyncio admin's per-call timeout bounds its calls the same way
                bounded(3.0, lambda: asyncio.run(async_admin.describe_transaction(txid, timeout=3)),
                        BrokerUnavailableError)
                bounded(3.0, lambda: asyncio.run(async_admin.list_transactions(timeout=3)), BrokerUnavailableError)
                bounded(3.0, lambda: admin.transaction_outcome(txid, state, timeout=3), BrokerUnavailableError)
                bounded(3.0, lambda: admin.complete_transaction(txid, state, timeout=3),
                        (BrokerUnavailableError, IndefiniteOutcomeError))
                bounded(3.0, lambda: admin.force_terminate_transaction(txid, timeout=3), BrokerUnavailableError)
            # Nothing was harmed: once the broker answers again, recovery settles the prepared transaction.
            settlement = admin.complete_transaction(txid, state, timeout=60)
            assert settlement.outcome is TransactionOutcome.COMMITTED, settlement
            asyncio.run(async_admin.close())
    finally:
        producer.close(5)


def test_end_txn_in_flight_when_the_broker_freezes_is_indefinite_within_the_timeout(
    private_kafka: LocalKafka,
) -> None:
    bootstrap = private_kafka.bootstrap_servers
    txid, state, producer = prepared_transaction(private_kafka)
    try:
        with ControlPlane({"bootstrap.servers": bootstrap}) as cp:
            desc = cp.describe_transaction(txid, timeout=30)
            assert desc is not None and desc.state == "Ongoing"
            with frozen(private_kafka):
                bounded(2.0, lambda: cp.end_txn(txid, desc.producer_id, desc.producer_epoch, commit=True, timeout=2),
                        IndefiniteOutcomeError)
            with TransactionAdmin({"bootstrap.servers": bootstrap}) as admin:
                settlement = admin.complete_transaction(txid, state, timeout=60)
                assert settlement.outcome is TransactionOutcome.COMMITTED, settlement
    finally:
        producer.close(5)


def test_killed_broker_bounds_every_admin_call(private_kafka: LocalKafka) -> None:
    bootstrap = private_kafka.bootstrap_servers
    txid, state, producer = prepared_transaction(private_kafka)
    try:
        with TransactionAdmin({"bootstrap.servers": bootstrap}) as admin:
            assert admin.describe_transaction(txid) is not None
            private_kafka.stop(kill=True)
            try:
                bounded(3.0, lambda: admin.describe_transaction(txid, timeout=3), BrokerUnavailableError)
                bounded(3.0, lambda: admin.complete_transaction(txid, state, timeout=3),
                        (BrokerUnavailableError, IndefiniteOutcomeError))
                bounded(3.0, lambda: admin.list_transactions(timeout=3), BrokerUnavailableError)
            finally:
                private_kafka.start()
            settlement = admin.complete_transaction(txid, state, timeout=90)
            assert settlement.outcome is TransactionOutcome.COMMITTED, settlement
    finally:
        producer.close(5)
