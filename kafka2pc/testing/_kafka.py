"""Topic creation and draining for tests, on confluent-kafka."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Literal

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from kafka2pc._control import ControlPlane
from kafka2pc._errors import kafka_error_of
from kafka2pc._logging import with_librdkafka_logger
from kafka2pc._types import TopicPartition as Partition

Isolation = Literal["read_committed", "read_uncommitted"]


@dataclass(frozen=True)
class Record:
    """One record read back by :func:`drain`."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


def create_topic(
    bootstrap_servers: str,
    name: str | None = None,
    *,
    partitions: int = 1,
    replication_factor: int = 1,
    config: dict[str, str] | None = None,
) -> str:
    """Create a topic (random name by default) and wait until it has leaders; return its name."""
    name = name or f"t-{uuid.uuid4().hex[:12]}"
    admin = AdminClient(with_librdkafka_logger({"bootstrap.servers": bootstrap_servers}))
    _create(admin, NewTopic(name, partitions, replication_factor, config=config or {}))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        md = admin.list_topics(name, timeout=10).topics.get(name)
        if md is not None and md.error is None and len(md.partitions) == partitions and all(
            p.leader >= 0 for p in md.partitions.values()
        ):
            return name
        time.sleep(0.1)
    raise TimeoutError(f"topic {name} has no leaders after 30s")


# Errors after which CreateTopics is sent again: on a cluster that has just
# started, librdkafka replaces its bootstrap connection by the brokers the
# metadata names, and a request in flight on it fails with _DESTROY_BROKER.
_CREATE_RETRIED = frozenset(
    {
        KafkaError._DESTROY_BROKER,
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError.NOT_CONTROLLER,
        KafkaError.REQUEST_TIMED_OUT,
    }
)


def _create(admin: AdminClient, topic: NewTopic, budget_s: float = 60.0) -> None:
    """Send CreateTopics until it succeeds or ``budget_s`` passes; a retry that finds the topic succeeds."""
    deadline = time.monotonic() + budget_s
    attempt = 0
    while True:
        attempt += 1
        future = admin.create_topics([topic], operation_timeout=30)[topic.topic]
        try:
            future.result(timeout=max(deadline - time.monotonic(), 1.0))
            return
        except KafkaException as exc:
            err = kafka_error_of(exc)
            code = err.code() if err is not None else None
            if code == KafkaError.TOPIC_ALREADY_EXISTS and attempt > 1:
                return  # an earlier attempt created it, though its answer was lost
            if (code not in _CREATE_RETRIED and not (err is not None and err.retriable())) or (
                time.monotonic() > deadline
            ):
                raise
        time.sleep(0.2)


def end_offsets(
    bootstrap_servers: str, topic: str, isolation: Isolation = "read_uncommitted"
) -> dict[int, int]:
    """Per partition: the high watermark (``read_uncommitted``) or last stable offset (``read_committed``)."""
    return _end_offsets(AdminClient(with_librdkafka_logger({"bootstrap.servers": bootstrap_servers})), topic, isolation)


def settled_end_offsets(bootstrap_servers: str, topic: str) -> dict[int, int]:
    """Per partition: the last stable offset once no transaction on ``topic`` is being completed.

    While the last stable offset of a partition is below its high watermark,
    the coordinators are asked about the transactions that hold it
    (DescribeProducers on the partition, ListTransactions): a transaction
    still ``Ongoing`` is open, and its records are not waited for; one that
    is being committed or aborted (markers on their way) is waited for, up to
    ``MARKER_DEADLINE_S``.  After the deadline the offsets are returned as
    they are, and the difference shows as a transaction left hanging.
    """
    return _settled_end_offsets(
        AdminClient(with_librdkafka_logger({"bootstrap.servers": bootstrap_servers})), bootstrap_servers, topic
    )


def wait_for_open_records(bootstrap_servers: str, topic: str, *, timeout: float = 30.0) -> dict[int, int]:
    """Wait until a record of an ``Ongoing`` transaction is on ``topic``; return the high watermarks.

    For tests that act on a transaction once the broker holds its records:
    some partition's last stable offset is below its high watermark, held by
    a producer whose transaction its coordinator reports ``Ongoing`` (not one
    whose markers are still being written).  Raises ``TimeoutError`` after
    ``timeout`` seconds.
    """
    admin = AdminClient(with_librdkafka_logger({"bootstrap.servers": bootstrap_servers}))
    deadline = time.monotonic() + timeout
    with _Holders(bootstrap_servers, topic) as holders:
        while True:
            high = _end_offsets(admin, topic, "read_uncommitted")
            held = holders.of(_end_offsets(admin, topic, "read_committed"), high)
            if held and held & holders.in_states(("Ongoing",)):
                return high
            if time.monotonic() > deadline:
                raise TimeoutError(f"no record of an open transaction reached {topic} in {timeout}s")
            time.sleep(0.01)


def _settled_end_offsets(admin: AdminClient, bootstrap_servers: str, topic: str) -> dict[int, int]:
    deadline = time.monotonic() + MARKER_DEADLINE_S
    with _Holders(bootstrap_servers, topic) as holders:
        while True:
            stable = _end_offsets(admin, topic, "read_committed")
            high = _end_offsets(admin, topic, "read_uncommitted")
            if stable == high or time.monotonic() > deadline:
                return stable
            held = holders.of(stable, high)
            if held and not held & holders.in_states(_COMPLETING):
                # Every transaction holding the offset is open at its coordinator, or unknown to it
                # (a hanging transaction): none is on its way to a marker.
                if _end_offsets(admin, topic, "read_committed") == stable:
                    return stable
            time.sleep(0.02)


class _Holders:
    """The producers whose open transactions hold a topic's last stable offsets, and their coordinators' view."""

    def __init__(self, bootstrap_servers: str, topic: str) -> None:
        self._config = {"bootstrap.servers": bootstrap_servers}
        self._topic = topic
        self._ctrl: ControlPlane | None = None

    def __enter__(self) -> _Holders:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ctrl is not None:
            self._ctrl.close()

    @property
    def ctrl(self) -> ControlPlane:
        if self._ctrl is None:  # only when a transaction is open: most calls never need one
            self._ctrl = ControlPlane(self._config)
        return self._ctrl

    def of(self, stable: dict[int, int], high: dict[int, int]) -> set[int]:
        """Producer ids with an open transaction on a partition whose ``stable`` end is below ``high``."""
        return {
            producer.producer_id
            for p, h in high.items() if stable.get(p, 0) < h
            for producer in self.ctrl.describe_producers(Partition(self._topic, p), timeout=10)
            if producer.current_txn_start_offset >= 0
        }

    def in_states(self, states: tuple[str, ...]) -> set[int]:
        """Producer ids of the transactions in one of ``states``, at every coordinator."""
        return {t.producer_id for t in self.ctrl.list_transactions(states=states, timeout=10)}


def _end_offsets(admin: AdminClient, topic: str, isolation: Isolation) -> dict[int, int]:
    from confluent_kafka import IsolationLevel
    from confluent_kafka.admin import OffsetSpec  # type: ignore[attr-defined]

    md = admin.list_topics(topic, timeout=10).topics[topic]
    level = (
        IsolationLevel.READ_COMMITTED if isolation == "read_committed" else IsolationLevel.READ_UNCOMMITTED
    )
    latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
    futures = admin.list_offsets(
        {TopicPartition(topic, p): latest for p in md.partitions},
        isolation_level=level,
        request_timeout=15,
    )
    return {tp.partition: int(f.result().offset) for tp, f in futures.items()}


MARKER_DEADLINE_S = 30.0
"""How long :func:`drain` waits for the markers of transactions whose coordinator is completing them."""

#: Coordinator states of a transaction whose markers are being written (or were, a moment ago).
_COMPLETING = ("PrepareCommit", "PrepareAbort", "PrepareEpochFence", "CompleteCommit", "CompleteAbort")


def drain(
    bootstrap_servers: str,
    topic: str,
    isolation: Isolation = "read_committed",
    *,
    timeout: float = 30.0,
) -> list[Record]:
    """Read every visible record of ``topic`` from the beginning to its current end.

    The end is the last stable offset for ``read_committed`` (so records of an
    open transaction are not waited for) and the high watermark otherwise.
    A transaction that has just committed is complete once its markers are
    written, a few milliseconds after ``commit_transaction`` returned (the
    coordinator writes them after it answered): see :func:`settled_end_offsets`.
    """
    admin = AdminClient(with_librdkafka_logger({"bootstrap.servers": bootstrap_servers}))
    if isolation == "read_committed":
        ends = _settled_end_offsets(admin, bootstrap_servers, topic)
    else:
        ends = _end_offsets(admin, topic, isolation)
    consumer = Consumer(
        with_librdkafka_logger({
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"k2pc-drain-{uuid.uuid4().hex[:8]}",
            "isolation.level": isolation,
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        })
    )
    records: list[Record] = []
    try:
        pending = {p for p, end in ends.items() if end > 0}
        consumer.assign([TopicPartition(topic, p, 0) for p in pending])  # 0 = from start
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"drain({topic}) did not reach {ends} in {timeout}s")
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            err = msg.error()
            partition, offset = int(msg.partition() or 0), int(msg.offset() or 0)
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    if offset >= ends[partition]:
                        pending.discard(partition)
                    continue
                raise RuntimeError(f"drain({topic}): {err}")
            records.append(Record(topic, partition, offset, msg.key(), msg.value()))
            if offset + 1 >= ends[partition]:
                pending.discard(partition)
        return records
    finally:
        consumer.close()
