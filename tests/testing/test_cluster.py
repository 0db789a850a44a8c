"""Three-node KRaft cluster: a prepared transaction survives the loss of its coordinator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kafka2pc import PreparedTxnState, TransactionAdmin
from kafka2pc.testing import create_topic, drain, end_offsets
from kafka2pc.testing.broker import LocalKafka

CHILD = textwrap.dedent(
    """
    import sys, time
    from kafka2pc import TwoPhaseCommitProducer
    bootstrap, tid, topic = sys.argv[1:4]
    p = TwoPhaseCommitProducer({"bootstrap.servers": bootstrap, "transactional.id": tid})
    p.init_transactions()
    p.begin_transaction()
    for i in range(6):
        p.produce(topic, value=b"rec-%d" % i, partition=i % 3)
    state = p.prepare_transaction()
    print("PREPARED", state, flush=True)
    time.sleep(600)
    """
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalKafka]:
    kafka = LocalKafka.up(brokers=3)
    yield kafka
    kafka.wipe()  # throwaway cluster: no need for a clean shutdown


def test_prepared_transaction_completes_after_coordinator_is_killed(cluster: LocalKafka) -> None:
    bootstrap = cluster.bootstrap_servers
    topic = create_topic(bootstrap, partitions=3, replication_factor=3)
    tid = f"failover-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, bootstrap, tid, topic], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline().split()
        assert line[0] == "PREPARED", line
        state = PreparedTxnState(line[1])
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()

    admin = TransactionAdmin({"bootstrap.servers": bootstrap}, request_timeout_s=20)
    try:
        info = admin.describe_transaction(tid)
        assert info is not None and info.state == "Ongoing"
        coordinator = info.description.coordinator_id
        cluster.stop_node(coordinator, kill=True)
        try:
            settlement = admin.complete_transaction(tid, state)
        finally:
            cluster.start_node(coordinator)
    finally:
        admin.close()

    assert settlement.outcome.value == "committed"
    values = sorted(r.value for r in drain(bootstrap, topic, "read_committed", timeout=60))
    assert values == sorted(b"rec-%d" % i for i in range(6))
    assert end_offsets(bootstrap, topic, "read_committed") == end_offsets(bootstrap, topic, "read_uncommitted")


def _leader_of(admin: Any, topic: str, timeout: float = 30.0) -> int:
    """The leader of ``topic``'s partition 0, once the broker answering Metadata lists it (a broker can
    answer for a topic just created before it has that partition)."""
    deadline = time.monotonic() + timeout
    while True:
        partitions = admin.list_topics(topic, timeout=20).topics[topic].partitions
        if 0 in partitions and partitions[0].leader >= 0:
            return int(partitions[0].leader)
        assert time.monotonic() < deadline, f"{topic}-0 has no leader in the metadata after {timeout} s"
        time.sleep(0.1)


def test_a_cached_partition_leader_that_died_is_looked_up_again(cluster: LocalKafka) -> None:
    """The control plane keeps a partition's leader; when that broker dies it asks Metadata again and goes on."""
    from confluent_kafka.admin import AdminClient

    from kafka2pc import TopicAndPartition

    bootstrap = cluster.bootstrap_servers
    topic = create_topic(bootstrap, partitions=1, replication_factor=3)
    tp = TopicAndPartition(topic, 0)
    admin = TransactionAdmin({"bootstrap.servers": bootstrap}, request_timeout_s=20)
    try:
        assert admin.describe_producers(tp) == []
        assert admin.describe_producers(tp) == []
        metadata = admin.control_plane.requests_sent["Metadata"]
        leader = _leader_of(AdminClient({"bootstrap.servers": bootstrap}), topic)
        cluster.stop_node(leader, kill=True)
        try:
            assert admin.describe_producers(tp, timeout=60) == []  # the new leader answers
            assert admin.control_plane.requests_sent["Metadata"] > metadata
        finally:
            cluster.start_node(leader)
    finally:
        admin.close()


def _wait_fenced(cluster: LocalKafka, node: int, timeout: float) -> float:
    """Wait until the cluster's metadata lists only the other brokers (the controller fenced ``node``)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from kafka2pc._logging import with_librdkafka_logger

    admin = AdminClient(with_librdkafka_logger({"bootstrap.servers": cluster.bootstrap_servers}))
    others = sorted(n.node_id for n in cluster.nodes if n.node_id != node)
    started = time.monotonic()
    listed: object = None
    while time.monotonic() - started < timeout:
        try:
            listed = sorted(admin.list_topics(timeout=5).brokers)
        except KafkaException as exc:  # a metadata request that went to the dead broker; ask again
            listed = exc
        if listed == others:
            return time.monotonic() - started
        time.sleep(0.5)
    raise AssertionError(f"broker {node} still listed {timeout:.0f}s after its kill: {listed}")


def test_new_producers_start_while_any_one_broker_is_dead(cluster: LocalKafka) -> None:
    """Each broker in turn is killed; once Kafka has fenced it, new producers start and commit within
    their bounds: each reads the brokers' ``transaction.max.timeout.ms`` (DescribeConfigs) from a live
    broker, although the dead one is still in ``bootstrap.servers`` and among the controllers.

    Until Kafka fences a killed broker (``broker.session.timeout.ms``, 9 s; longer on a loaded machine)
    the transactional ids it coordinated have no coordinator, and ``init_transactions`` for them ends at
    its bound with ``RetriableError``; test_prepared_transaction_completes_after_coordinator_is_killed
    covers that failover."""
    from kafka2pc import TwoPhaseCommitProducer

    bootstrap = cluster.bootstrap_servers
    topic = create_topic(bootstrap, partitions=3, replication_factor=3)
    series = uuid.uuid4().hex[:8]
    for node in (1, 2, 3):
        cluster.stop_node(node, kill=True)
        try:
            fenced_after = _wait_fenced(cluster, node, timeout=120)
            print(f"\nbroker {node} dead: fenced after {fenced_after:.1f}s")
            for i in range(2):
                tid = f"start-{series}-{node}-{i}"
                started = time.monotonic()
                with TwoPhaseCommitProducer({"bootstrap.servers": bootstrap, "transactional.id": tid}) as p:
                    p.init_transactions(30)
                    p.begin_transaction()
                    p.produce(topic, value=f"{node}-{i}".encode())
                    p.commit_transaction(30)
                took = time.monotonic() - started
                print(f"broker {node} dead: producer {i} started and committed in {took:.1f}s")
                assert took <= 30, took  # no call waited out its bound on the dead broker
        finally:
            cluster.start_node(node, wait=False)
            cluster.wait_ready(timeout=300)  # a JVM restarted on a loaded machine
    values = sorted(r.value for r in drain(bootstrap, topic, "read_committed", timeout=60))
    assert values == sorted(f"{n}-{i}".encode() for n in (1, 2, 3) for i in range(2))
    assert end_offsets(bootstrap, topic, "read_committed") == end_offsets(bootstrap, topic, "read_uncommitted")
