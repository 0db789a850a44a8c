"""The local broker is real Apache Kafka: transactions behave as Kafka's do."""

from __future__ import annotations

import json
import logging
import time
import uuid

from confluent_kafka import Producer

from kafka2pc._control import ControlPlane
from kafka2pc.testing import create_topic, drain, end_offsets

log = logging.getLogger(__name__)


def _producer(bootstrap: str) -> Producer:
    return Producer({"bootstrap.servers": bootstrap, "transactional.id": f"smoke-{uuid.uuid4().hex[:8]}"})


def test_read_committed_sees_only_committed_transaction(any_kafka_bootstrap: str) -> None:
    topic = create_topic(any_kafka_bootstrap, partitions=2)
    producer = _producer(any_kafka_bootstrap)
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(3):
        producer.produce(topic, key=b"c%d" % i, value=b"committed-%d" % i, partition=i % 2)
    producer.commit_transaction(30)
    producer.begin_transaction()
    for i in range(2):
        producer.produce(topic, key=b"a%d" % i, value=b"aborted-%d" % i, partition=i % 2)
    producer.flush(30)  # abort_transaction() purges unsent records: make them reach the log first
    producer.abort_transaction(30)

    committed = drain(any_kafka_bootstrap, topic, "read_committed")
    uncommitted = drain(any_kafka_bootstrap, topic, "read_uncommitted")

    assert sorted(r.value for r in committed) == [b"committed-0", b"committed-1", b"committed-2"]
    assert sorted(r.value for r in uncommitted) == sorted(
        [b"committed-0", b"committed-1", b"committed-2", b"aborted-0", b"aborted-1"]
    )
    # Nothing left hanging: the last stable offset caught up with the high watermark.
    assert end_offsets(any_kafka_bootstrap, topic, "read_committed") == end_offsets(
        any_kafka_bootstrap, topic, "read_uncommitted"
    )


def test_open_transaction_pins_last_stable_offset(kafka_bootstrap: str) -> None:
    topic = create_topic(kafka_bootstrap)
    producer = _producer(kafka_bootstrap)
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"open")
    producer.flush(30)
    try:
        assert end_offsets(kafka_bootstrap, topic, "read_uncommitted") == {0: 1}
        assert end_offsets(kafka_bootstrap, topic, "read_committed") == {0: 0}
        began = time.monotonic()
        assert drain(kafka_bootstrap, topic, "read_committed") == []
        # An open transaction is not waited for: its coordinator says it is Ongoing.
        assert time.monotonic() - began < 10
    finally:
        producer.abort_transaction(30)


def test_drain_right_after_a_commit_sees_the_committed_records(kafka_bootstrap: str) -> None:
    """commit_transaction returns before the coordinator wrote the markers; drain waits for them."""
    topic = create_topic(kafka_bootstrap, partitions=3)
    producer = _producer(kafka_bootstrap)
    producer.init_transactions(30)
    expected: list[bytes] = []
    for n in range(15):
        producer.begin_transaction()
        for i in range(3):
            value = b"%d-%d" % (n, i)
            producer.produce(topic, value=value, partition=(n + i) % 3)
            expected.append(value)
        producer.commit_transaction(30)
        assert sorted(r.value for r in drain(kafka_bootstrap, topic)) == sorted(expected)


TRANSACTION_APIS = ["InitProducerId", "EndTxn", "DescribeTransactions", "DescribeProducers", "ListTransactions"]


def test_api_versions_advertised(any_kafka_bootstrap: str, record_property: object) -> None:
    # kafka2pc's control plane, not KafkaAdminClient.api_versions(): kafka-python 3.0
    # raises ValueError on API keys it does not know (4.4.0 advertises key 93).
    with ControlPlane({"bootstrap.servers": any_kafka_bootstrap}, request_timeout_s=15) as cp:
        versions = cp.api_versions()
    advertised = {name: versions.get(name) for name in TRANSACTION_APIS}
    log.warning("ApiVersions at %s: %s", any_kafka_bootstrap, json.dumps(advertised))
    record_property("api_versions", json.dumps(advertised))  # type: ignore[operator]
    for name in TRANSACTION_APIS:
        assert advertised[name] is not None, f"{name} not advertised"
    # Every supported broker line knows the InitProducerId version librdkafka needs (>= 3, KIP-360).
    assert advertised["InitProducerId"][1] >= 3
