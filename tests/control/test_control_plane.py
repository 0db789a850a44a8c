"""Integration tests of the control plane against a real broker.

The broker and topics come from the shared ``kafka2pc.testing`` fixtures
(``kafka_bootstrap``, ``topic_factory``).  The indefinite outcome of EndTxn is
tested against a broker that really stops answering in
``tests/core/test_indefinite.py``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka import TopicPartition as CTopicPartition
from confluent_kafka.admin import AdminClient

from kafka2pc._control import ControlPlane
from kafka2pc._exceptions import (
    HeuristicOutcomeError,
    ProducerFencedError,
    UnsupportedBrokerError,
    UsageError,
)
from kafka2pc._types import TopicPartition

# A transactional librdkafka producer that writes one or more transactions
# (all but the last committed), prints the delivery reports, then waits to be
# killed with its last transaction open.
_CHILD = r"""
import json, sys, time
from confluent_kafka import Producer
bootstrap, topic, txid, per_txn, txns = sys.argv[1:6]
p = Producer({"bootstrap.servers": bootstrap, "transactional.id": txid,
              "transaction.timeout.ms": 600000})
p.init_transactions(30)
reports = []
for t in range(int(txns)):
    p.begin_transaction()
    for i in range(int(per_txn)):
        p.produce(topic, f"t{t}-r{i}".encode(),
                  on_delivery=lambda err, m: reports.append([m.partition(), m.offset(), t]))
    p.flush(30)
    if t < int(txns) - 1:
        p.commit_transaction(30)
print(json.dumps(reports), flush=True)
time.sleep(600)
"""


@pytest.fixture
def control(kafka_bootstrap: str) -> Iterator[ControlPlane]:
    with ControlPlane({"bootstrap.servers": kafka_bootstrap}, request_timeout_s=15) as cp:
        yield cp


def killed_producer(bootstrap: str, topic: str, *, per_txn: int = 3, txns: int = 1) -> tuple[str, list[list[int]]]:
    """Run a transactional producer in a subprocess, SIGKILL it mid-transaction.

    Returns the transactional id and the delivery reports ``[partition, offset, txn]``.
    """
    txid = f"k2pc-tx-{uuid.uuid4().hex[:10]}"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, bootstrap, topic, txid, str(per_txn), str(txns)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    reports = json.loads(line)
    assert len(reports) == per_txn * txns
    return txid, reports


def read_committed(bootstrap: str, topic: str, partition: int = 0, timeout_s: float = 10) -> list[tuple[int, bytes]]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"k2pc-test-{uuid.uuid4().hex}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    consumer.assign([CTopicPartition(topic, partition, 0)])
    records: list[tuple[int, bytes]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                continue
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    return records
                continue
            value = message.value()
            offset = message.offset()
            assert isinstance(value, bytes) and offset is not None
            records.append((offset, value))
    finally:
        consumer.close()
    raise AssertionError("read_committed consumer did not reach the end of the partition")


# -- metadata ------------------------------------------------------------------


def test_api_versions_lists_the_transactional_apis(control: ControlPlane) -> None:
    versions = control.api_versions()
    for name in ("InitProducerId", "EndTxn", "DescribeTransactions", "DescribeProducers", "ListTransactions"):
        low, high = versions[name]
        assert 0 <= low <= high
    assert versions["EndTxn"][1] >= 3


def test_broker_config_reads_transaction_settings(control: ControlPlane) -> None:
    values = control.broker_config(["transaction.max.timeout.ms", "no.such.setting"])
    assert int(values["transaction.max.timeout.ms"]) > 0
    assert "no.such.setting" not in values


def test_unknown_transactional_id_is_none(control: ControlPlane) -> None:
    assert control.describe_transaction(f"never-used-{uuid.uuid4().hex}") is None


def test_closed_control_plane_refuses_calls(kafka_bootstrap: str) -> None:
    cp = ControlPlane({"bootstrap.servers": kafka_bootstrap})
    cp.close()
    with pytest.raises(UsageError):
        cp.describe_transaction("x")


# -- recovery of a crashed librdkafka transaction -----------------------------


def test_killed_producer_is_described_and_committed_by_end_txn(
    control: ControlPlane, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory()
    tp = TopicPartition(topic, 0)
    txid, reports = killed_producer(kafka_bootstrap, topic)
    first_offset = reports[0][1]

    description = control.describe_transaction(txid)
    assert description is not None
    assert description.state == "Ongoing"
    assert description.partitions == (tp,)
    assert description.producer_id >= 0 and description.producer_epoch >= 0
    assert description.start_time_ms > 0

    producers = control.describe_producers(tp)
    mine = [p for p in producers if p.producer_id == description.producer_id]
    assert len(mine) == 1
    assert mine[0].producer_epoch == description.producer_epoch
    assert mine[0].current_txn_start_offset == first_offset

    assert control.record_outcome(tp, first_offset) == "ongoing"
    assert read_committed(kafka_bootstrap, topic) == []

    control.end_txn(txid, description.producer_id, description.producer_epoch, commit=True)
    assert [v for _, v in read_committed(kafka_bootstrap, topic)] == [b"t0-r0", b"t0-r1", b"t0-r2"]
    after = control.describe_transaction(txid)
    assert after is not None and after.state == "CompleteCommit"
    # EndTxn v<=4 keeps TV1 semantics: the epoch is not bumped.
    assert (after.producer_id, after.producer_epoch) == (description.producer_id, description.producer_epoch)

    # Repeating the same decision is harmless ...
    control.end_txn(txid, description.producer_id, description.producer_epoch, commit=True)
    # ... the opposite one reports what Kafka did.
    with pytest.raises(HeuristicOutcomeError) as raised:
        control.end_txn(txid, description.producer_id, description.producer_epoch, commit=False)
    assert raised.value.outcome == "committed"
    assert raised.value.error_name == "INVALID_TXN_STATE"
    assert control.record_outcome(tp, first_offset) == "committed"
    assert len(read_committed(kafka_bootstrap, topic)) == 3


def test_killed_producer_is_aborted_by_end_txn(
    control: ControlPlane, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory()
    tp = TopicPartition(topic, 0)
    txid, reports = killed_producer(kafka_bootstrap, topic)
    description = control.describe_transaction(txid)
    assert description is not None and description.state == "Ongoing"

    control.end_txn(txid, description.producer_id, description.producer_epoch, commit=False)
    control.end_txn(txid, description.producer_id, description.producer_epoch, commit=False)
    assert read_committed(kafka_bootstrap, topic) == []
    for _, offset, _ in reports:
        assert control.record_outcome(tp, offset) == "aborted"
    # CONCURRENT_TRANSACTIONS (markers still being written) is retried inside end_txn.
    with pytest.raises(HeuristicOutcomeError) as raised:
        control.end_txn(txid, description.producer_id, description.producer_epoch, commit=True)
    assert raised.value.outcome == "aborted"


def test_end_txn_with_wrong_ids_is_fenced_and_leaves_the_transaction_open(
    control: ControlPlane, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory()
    txid, _ = killed_producer(kafka_bootstrap, topic)
    description = control.describe_transaction(txid)
    assert description is not None
    with pytest.raises(ProducerFencedError) as wrong_epoch:
        control.end_txn(txid, description.producer_id, description.producer_epoch + 1, commit=True)
    assert wrong_epoch.value.error_name == "PRODUCER_FENCED"
    with pytest.raises(ProducerFencedError) as wrong_pid:
        control.end_txn(txid, description.producer_id + 1, description.producer_epoch, commit=True)
    assert wrong_pid.value.error_name == "INVALID_PRODUCER_ID_MAPPING"
    again = control.describe_transaction(txid)
    assert again == description


def test_consecutive_librdkafka_transactions_share_producer_id_and_epoch(
    control: ControlPlane, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    """TV1: {producer_id, epoch} does not name one transaction; the anchor does."""
    topic = topic_factory()
    tp = TopicPartition(topic, 0)
    txid, reports = killed_producer(kafka_bootstrap, topic, per_txn=2, txns=2)
    description = control.describe_transaction(txid)
    assert description is not None and description.state == "Ongoing"
    second_anchor = [offset for _, offset, txn in reports if txn == 1][0]
    first_anchor = [offset for _, offset, txn in reports if txn == 0][0]
    mine = [p for p in control.describe_producers(tp) if p.producer_id == description.producer_id]
    assert mine[0].current_txn_start_offset == second_anchor != first_anchor
    assert mine[0].producer_epoch == description.producer_epoch
    assert control.record_outcome(tp, first_anchor) == "committed"
    assert control.record_outcome(tp, second_anchor) == "ongoing"


def test_ids_are_readable_after_init_transactions(
    control: ControlPlane, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory()
    txid = f"k2pc-tx-{uuid.uuid4().hex[:10]}"
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": txid})
    producer.init_transactions(30)
    after_init = control.describe_transaction(txid)
    assert after_init is not None and after_init.state == "Empty"
    assert after_init.partitions == ()
    ids = []
    for _ in range(2):
        producer.begin_transaction()
        producer.produce(topic, b"x")
        producer.flush(30)
        ongoing = control.describe_transaction(txid)
        assert ongoing is not None and ongoing.state == "Ongoing"
        ids.append((ongoing.producer_id, ongoing.producer_epoch))
        producer.commit_transaction(30)
    assert ids[0] == ids[1] == (after_init.producer_id, after_init.producer_epoch)


# -- InitProducerId -------------------------------------------------------------


def test_keep_prepared_txn_is_refused_or_keeps_the_transaction(
    control: ControlPlane, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory()
    tp = TopicPartition(topic, 0)
    txid, reports = killed_producer(kafka_bootstrap, topic)
    before = control.describe_transaction(txid)
    producers_before = control.describe_producers(tp)
    assert before is not None
    supported = control.supports_keep_prepared_txn()
    assert control.supports_keep_prepared_txn() is supported  # cached, stable
    if control.api_versions()["InitProducerId"][1] < 6:
        assert supported is False
    for flags in ({"keep_prepared_txn": True}, {"keep_prepared_txn": True, "enable_2pc": True}):
        if supported:
            result = control.init_producer_id(txid, transaction_timeout_ms=60_000, **flags)
            assert (result.ongoing_txn_producer_id, result.ongoing_txn_epoch) == (
                before.producer_id,
                before.producer_epoch,
            )
        else:
            with pytest.raises(UnsupportedBrokerError):
                control.init_producer_id(txid, transaction_timeout_ms=60_000, **flags)
    # Either way the prepared transaction is still open and still the same one.
    after = control.describe_transaction(txid)
    assert after is not None and after.state == "Ongoing"
    assert after.partitions == before.partitions
    anchors = {p.producer_id: p.current_txn_start_offset for p in control.describe_producers(tp)}
    assert anchors[before.producer_id] == reports[0][1]
    if not supported:
        assert after == before
        assert control.describe_producers(tp) == producers_before


def test_force_terminate_aborts_and_bumps_the_epoch(
    control: ControlPlane, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory()
    tp = TopicPartition(topic, 0)
    txid, reports = killed_producer(kafka_bootstrap, topic)
    before = control.describe_transaction(txid)
    assert before is not None
    result = control.init_producer_id(txid, transaction_timeout_ms=60_000)
    assert result.producer_id == before.producer_id
    assert result.producer_epoch > before.producer_epoch
    assert control.record_outcome(tp, reports[0][1]) == "aborted"
    with pytest.raises(ProducerFencedError):
        control.end_txn(txid, before.producer_id, before.producer_epoch, commit=True)


# -- ListTransactions / record_outcome -----------------------------------------


def test_list_transactions_filters_by_state_and_duration(
    control: ControlPlane, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    txid, _ = killed_producer(kafka_bootstrap, topic_factory())
    ongoing = {t.transactional_id: t for t in control.list_transactions(states=["Ongoing"])}
    assert txid in ongoing and ongoing[txid].state == "Ongoing"
    assert txid not in {t.transactional_id for t in control.list_transactions(states=["CompleteCommit"])}
    assert txid not in {t.transactional_id for t in control.list_transactions(min_duration_ms=3_600_000)}
    assert txid in {t.transactional_id for t in control.list_transactions(min_duration_ms=0)}


def test_record_outcome_unknown_below_log_start(
    control: ControlPlane, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory()
    tp = TopicPartition(topic, 0)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(5):
        producer.produce(topic, str(i).encode())
    producer.flush(30)
    assert control.record_outcome(tp, 1) == "committed"  # non-transactional records are visible
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for future in admin.delete_records([CTopicPartition(topic, 0, 3)]).values():
        future.result(30)
    assert control.record_outcome(tp, 1) == "unknown"
    assert control.record_outcome(tp, 3) == "committed"
    assert control.record_outcome(tp, 5) == "ongoing"  # nothing stable there yet


def _serving(bootstrap: str, topic: str, partitions: int, timeout: float = 30.0) -> None:
    """Wait until every partition of a new ``topic`` answers ListOffsets at its leader (asked by another client).

    A partition whose leader is elected may refuse requests for a moment while its replica starts (on a
    loaded machine): the control plane would then, rightly, look its leader up again.
    """
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"serving-{uuid.uuid4().hex[:8]}"})
    try:
        deadline = time.monotonic() + timeout
        for partition in range(partitions):
            while True:
                try:
                    consumer.get_watermark_offsets(CTopicPartition(topic, partition), timeout=5)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
    finally:
        consumer.close()


def test_partition_leader_is_looked_up_once(
    control: ControlPlane, topic_factory: Callable[..., str], kafka_bootstrap: str
) -> None:
    """Calls routed to a partition leader ask Metadata for it once, then go straight to the leader."""
    tp = TopicPartition(topic_factory(partitions=2), 1)
    _serving(kafka_bootstrap, tp.topic, 2)
    before = control.requests_sent.get("Metadata", 0)
    for _ in range(3):
        assert control.describe_producers(tp) == []
        log_start, stable, high = control.partition_offsets(tp)
        assert (log_start, stable, high) == (0, 0, 0)
    sent = control.requests_sent
    assert sent["Metadata"] == before + 1
    assert sent["DescribeProducers"] >= 3
    other = TopicPartition(tp.topic, 0)  # another partition is looked up on its own
    control.describe_producers(other)
    assert control.requests_sent["Metadata"] == before + 2
