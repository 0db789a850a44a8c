"""What each broker line offers, observed by ApiVersions and probes (see docs/capabilities.md).

These tests pin the capability matrix: if a broker release starts offering
KIP-939 to clients, they fail and the document (and the producer's refusal of
``transaction.two.phase.commit.enable``) must be revisited.
"""

from __future__ import annotations

import uuid

import pytest

from kafka2pc import TransactionAdmin, TwoPhaseCommitProducer, TxnState, UnsupportedBrokerError, UsageError
from kafka2pc._control import ControlPlane
from kafka2pc._producer_config import LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS

REQUIRED_APIS = ("InitProducerId", "EndTxn", "DescribeTransactions", "DescribeProducers", "ListOffsets", "FindCoordinator")


def test_apis_the_coordinator_direct_path_needs(any_kafka_bootstrap: str) -> None:
    with ControlPlane({"bootstrap.servers": any_kafka_bootstrap}, request_timeout_s=15) as cp:
        versions = cp.api_versions()
        for api in REQUIRED_APIS:
            low, high = versions[api]
            assert low <= high
        assert versions["EndTxn"][1] >= 4  # kafka2pc sends at most v4 (TV1 semantics)
        # KIP-939's InitProducerId v6 (Enable2Pc, KeepPreparedTxn) is not offered to clients ...
        assert versions["InitProducerId"][1] == 5
        # ... so keeping a prepared transaction across InitProducerId is not possible.
        assert cp.supports_keep_prepared_txn() is False


def test_two_phase_commit_setting_is_refused_with_a_clear_reason(any_kafka_bootstrap: str) -> None:
    producer = TwoPhaseCommitProducer(
        {
            "bootstrap.servers": any_kafka_bootstrap,
            "transactional.id": f"k2pc-caps-{uuid.uuid4().hex[:8]}",
            "transaction.two.phase.commit.enable": "true",
        }
    )
    with pytest.raises(UnsupportedBrokerError) as raised:
        producer.init_transactions()
    message = str(raised.value)
    assert "does not offer 2PC" in message
    assert "InitProducerId up to v5" in message  # both lines: the broker does not offer v6
    assert "transaction.max.timeout.ms" in message  # what to do instead
    assert producer.state is TxnState.UNINITIALIZED
    producer.close()


def test_two_phase_commit_setting_excludes_a_transaction_timeout() -> None:
    with pytest.raises(UsageError, match="transaction.timeout.ms"):
        TwoPhaseCommitProducer(
            {
                "bootstrap.servers": "127.0.0.1:1",
                "transactional.id": "x",
                "transaction.two.phase.commit.enable": True,
                "transaction.timeout.ms": 1000,
            }
        )
    with pytest.raises(UsageError, match="true or false"):
        TwoPhaseCommitProducer(
            {"bootstrap.servers": "127.0.0.1:1", "transactional.id": "x", "transaction.two.phase.commit.enable": "maybe"}
        )


def test_prepared_transactions_are_bounded_by_the_brokers_maximum(any_kafka_bootstrap: str) -> None:
    """Without a transaction.timeout.ms of its own, a producer takes the broker's maximum, within librdkafka's."""
    tid = f"k2pc-caps-{uuid.uuid4().hex[:8]}"
    config = {"bootstrap.servers": any_kafka_bootstrap, "transactional.id": tid}
    with TwoPhaseCommitProducer(config) as producer:
        producer.init_transactions()
        limit = int(producer.control_plane.broker_config(["transaction.max.timeout.ms"])["transaction.max.timeout.ms"])
        with TransactionAdmin({"bootstrap.servers": any_kafka_bootstrap}) as admin:
            info = admin.describe_transaction(tid)
        # ... capped at librdkafka's limit (the test broker's maximum is one hour, above it).
        assert info is not None and info.description.timeout_ms == min(limit, LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS)


@pytest.mark.parametrize("timeout_ms", [2_147_484, 3_600_000, "3600000"])
def test_a_transaction_timeout_librdkafka_cannot_handle_is_refused(timeout_ms: object) -> None:
    """Above 2**31 microseconds librdkafka's request deadlines wrap: refused before anything connects."""
    config = {"bootstrap.servers": "127.0.0.1:1", "transactional.id": "t", "transaction.timeout.ms": timeout_ms}
    with pytest.raises(UsageError, match="wrap around"):
        TwoPhaseCommitProducer(config)


def test_a_malformed_transaction_timeout_is_refused() -> None:
    config = {"bootstrap.servers": "127.0.0.1:1", "transactional.id": "t", "transaction.timeout.ms": "15m"}
    with pytest.raises(UsageError, match="integer number of milliseconds"):
        TwoPhaseCommitProducer(config)
