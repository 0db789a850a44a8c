"""KRaft cluster ids that start with '-' (1 in 64 random ids) must not break formatting."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient
from harness.ports import port_of

from kafka2pc.testing import broker


def test_random_cluster_ids_never_start_with_a_dash() -> None:
    ids = [broker.random_cluster_id() for _ in range(5000)]
    assert not [i for i in ids if i.startswith("-")]
    assert all(len(i) == 22 for i in ids)


def test_a_cluster_id_starting_with_a_dash_formats_and_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ids made elsewhere (an older kafka2pc, or copied from another cluster) may start with '-'.
    monkeypatch.setattr(broker, "random_cluster_id", lambda: "-QbtlDkPTnqG8lRdQT7Miw")
    kafka = broker.LocalKafka(base_port=port_of("testing/test_broker_cluster_id"))
    try:
        kafka.start()
        admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
        cluster = admin.describe_cluster(request_timeout=20).result(timeout=30)
        assert cluster.cluster_id == "-QbtlDkPTnqG8lRdQT7Miw"
    finally:
        kafka.wipe()
