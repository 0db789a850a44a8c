"""Topic creation and draining for tests, on confluent-kafka."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Literal

from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from kafka2pc._logging import with_librdkafka_logger

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
    futures = admin.create_topics(
        [NewTopic(name, partitions, replication_factor, config=config or {})],
        operation_timeout=30,
    )
    futures[name].result(timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        md = admin.list_topics(name, timeout=10).topics.get(name)
        if md is not None and md.error is None and len(md.partitions) == partitions and all(
            p.leader >= 0 for p in md.partitions.values()
        ):
            return name
        time.sleep(0.1)
    raise TimeoutError(f"topic {name} has no leaders after 30s")


def end_offsets(
    bootstrap_servers: str, topic: str, isolation: Isolation = "read_uncommitted"
) -> dict[int, int]:
    """Per partition: the high watermark (``read_uncommitted``) or last stable offset (``read_committed``)."""
    return _end_offsets(AdminClient(with_librdkafka_logger({"bootstrap.servers": bootstrap_servers})), topic, isolation)


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


MARKER_WAIT_S = 1.0
"""How long :func:`drain` waits for a just-committed transaction's markers to move the last stable offset."""


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
    coordinator writes them after it answered): while the last stable offset
    is below the high watermark, it is read again for up to
    ``MARKER_WAIT_S`` (then an open transaction is taken as open).
    """
    admin = AdminClient(with_librdkafka_logger({"bootstrap.servers": bootstrap_servers}))
    ends = _end_offsets(admin, topic, isolation)
    if isolation == "read_committed":
        waited_until = time.monotonic() + MARKER_WAIT_S
        while time.monotonic() < waited_until:
            high = _end_offsets(admin, topic, "read_uncommitted")
            if all(ends.get(p, 0) >= h for p, h in high.items()):
                break
            time.sleep(0.02)
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
