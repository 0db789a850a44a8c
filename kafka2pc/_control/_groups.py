"""Consumer groups whose committed offsets are pending in an open transaction.

A transaction that called ``send_offsets_to_transaction`` holds the group's
new offsets as *pending* until it ends.  Meanwhile the group coordinator
answers an ``OffsetFetch`` with ``require_stable=true`` with
``UNSTABLE_OFFSET_COMMIT`` for those partitions: a consumer (re)starting in
that group waits.  The transaction's own coordinator lists the group's
``__consumer_offsets`` partition among the transaction's partitions
(``DescribeTransactions``), which is how the holder is found.

A pending offset is a transactional record in the group's
``__consumer_offsets`` partition, which holds that partition's last stable
offset back.  So the search is:

1. the ``__consumer_offsets`` partitions held back (one ``Metadata`` and two
   ``ListOffsets`` requests per broker, :mod:`kafka2pc._control._lag`); none:
   no group has pending offsets, and nothing more is asked;
2. every broker is asked ``ListGroups`` (a group whose only offsets are
   pending is listed too); the *candidates* are the groups stored in a
   held-back partition;
3. each candidate is asked ``OffsetFetch`` with ``require_stable`` for every
   partition of every topic that is not internal, on the broker that
   coordinates it (every other one answers ``NOT_COORDINATOR``).  Naming the
   partitions matters: asked for "all its offsets", the coordinator answers
   only for partitions that have a committed offset, so a brand-new group
   whose first offsets are pending would be missed.

The cost is ``1 + 2 x brokers + brokers + candidates x (1..brokers)`` requests;
a candidate's ``OffsetFetch`` names every partition of the cluster.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from kafka.admin import KafkaAdminClient
from kafka.protocol.admin.groups import ListGroupsRequest
from kafka.protocol.consumer.group import OffsetFetchRequest

from kafka2pc._control import _kafka_python as compat
from kafka2pc._control import _protocol as protocol
from kafka2pc._control._retry import Route, check_code
from kafka2pc._errors import WireError, translate_kafka_python_error
from kafka2pc._types import TopicPartition

if TYPE_CHECKING:
    from kafka2pc._control._plane import ControlPlane
    from kafka2pc._control._session import Session

__all__ = [
    "CONSUMER_OFFSETS_TOPIC",
    "UNSTABLE_OFFSET_COMMIT",
    "consumer_offsets_partition_count",
    "java_string_hash",
    "offsets_partition",
    "pending_offset_groups",
    "pending_offset_holders",
]

CONSUMER_OFFSETS_TOPIC = "__consumer_offsets"
UNSTABLE_OFFSET_COMMIT = 88
"""Kafka's wire error: offsets of this group are pending in an open transaction (``require_stable``)."""
_ASK_ANOTHER_BROKER = frozenset(
    {WireError.COORDINATOR_LOAD_IN_PROGRESS, WireError.COORDINATOR_NOT_AVAILABLE, WireError.NOT_COORDINATOR}
)


def java_string_hash(text: str) -> int:
    """Java's ``String.hashCode()`` (over UTF-16 code units), as a signed 32-bit int."""
    value = 0
    data = text.encode("utf-16-be")
    for i in range(0, len(data), 2):
        value = (31 * value + ((data[i] << 8) | data[i + 1])) & 0xFFFFFFFF
    return value - (1 << 32) if value >= (1 << 31) else value


def offsets_partition(group_id: str, partition_count: int) -> int:
    """The ``__consumer_offsets`` partition of ``group_id`` (Kafka's ``Utils.abs(hashCode) % count``)."""
    code = java_string_hash(group_id)
    return (0 if code == -(1 << 31) else abs(code)) % partition_count


def consumer_offsets_partition_count(session: Session, *, timeout: float | None = None) -> int:
    """How many partitions ``__consumer_offsets`` has (Metadata; 0 if the topic does not exist yet)."""
    context = f"Metadata for {CONSUMER_OFFSETS_TOPIC}"
    deadline = session.call_deadline(timeout)

    async def go(admin: KafkaAdminClient) -> int:
        response = await session.send(admin, protocol.metadata(CONSUMER_OFFSETS_TOPIC), None, deadline, context)
        for topic in response.topics:
            if topic.name == CONSUMER_OFFSETS_TOPIC and not topic.error_code:
                return len(topic.partitions)
        return 0

    return session.run(context, deadline, go)


def pending_offset_groups(plane: ControlPlane, *, timeout: float | None = None) -> dict[str, list[TopicPartition]]:
    """Per consumer group with offsets pending in an open transaction: the partitions whose offsets are pending."""
    from kafka2pc._control._lag import held_back_partitions

    context = "ListGroups / OffsetFetch (require_stable)"
    deadline = plane.session.call_deadline(timeout)
    with plane.deadline(deadline.remaining()):
        held = {lag.partition for lag in held_back_partitions(plane, topics=[CONSUMER_OFFSETS_TOPIC])}
        if not held:
            return {}
        count = consumer_offsets_partition_count(plane.session)

    async def go(admin: KafkaAdminClient) -> dict[str, list[TopicPartition]]:
        brokers = compat.broker_ids(admin)
        groups: set[str] = set()
        for node_id in brokers:
            response = await plane.session.send(admin, ListGroupsRequest(max_version=4), node_id, deadline, context)
            if response.error_code:
                raise translate_kafka_python_error(response.error_code, f"ListGroups on broker {node_id}")
            groups.update(str(g.group_id) for g in response.groups)
        candidates = sorted(g for g in groups if count and offsets_partition(g, count) in held)
        if not candidates:
            return {}
        metadata = await plane.session.send(admin, protocol.metadata(None), None, deadline, context, label="ListTopics")
        topics = [
            OffsetFetchRequest.OffsetFetchRequestTopic(
                name=str(t.name), partition_indexes=sorted(int(p.partition_index) for p in t.partitions))
            for t in sorted(metadata.topics, key=lambda t: str(t.name))
            if not t.error_code and not t.is_internal
        ]
        pending: dict[str, list[TopicPartition]] = {}
        for group_id in candidates:
            for node_id in brokers:
                request = OffsetFetchRequest(group_id=group_id, topics=topics, require_stable=True,
                                             min_version=7, max_version=7)
                response = await plane.session.send(admin, request, node_id, deadline, context)
                if response.error_code in _ASK_ANOTHER_BROKER:
                    continue
                if response.error_code not in (WireError.NONE, UNSTABLE_OFFSET_COMMIT):
                    raise translate_kafka_python_error(response.error_code, f"OffsetFetch for group {group_id!r}")
                unstable = [
                    TopicPartition(str(t.name), int(p.partition_index))
                    for t in response.topics
                    for p in t.partitions
                    if p.error_code == UNSTABLE_OFFSET_COMMIT
                ]
                if unstable or response.error_code == UNSTABLE_OFFSET_COMMIT:
                    pending[group_id] = sorted(unstable)
                break
        return pending

    return plane.session.run(context, deadline, go)


PENDING_READ_MAX_BYTES = 16 << 20
"""How much of a ``__consumer_offsets`` partition :func:`pending_offset_holders` reads, at most."""


def _offset_commit_group(key: bytes | None) -> str | None:
    """The group of an offset-commit record's key (key versions 0 and 1); ``None`` for any other record."""
    if key is None or len(key) < 4 or int.from_bytes(key[:2], "big", signed=True) not in (0, 1):
        return None
    length = int.from_bytes(key[2:4], "big", signed=True)
    return key[4:4 + length].decode("utf-8", "replace") if length >= 0 else None


def pending_offset_holders(
    plane: ControlPlane, group_ids: Collection[str], *, timeout: float | None = None
) -> dict[str, list[int]]:
    """Per group: the producer ids whose open transaction holds pending offsets of the group.

    Two groups can be stored in one ``__consumer_offsets`` partition, so a
    transaction writing there may hold either's offsets.  The partition's
    leader says which producers have a transaction open there
    (DescribeProducers); their records, read from the first of those
    transactions to the partition's end (Fetch, ``READ_UNCOMMITTED``, at most
    :data:`PENDING_READ_MAX_BYTES`), name the groups whose offsets they carry.
    A group the read did not reach (past the cap) is given every producer
    with a transaction open in its partition.
    """
    from kafka.record.memory_records import MemoryRecords

    context = "Fetch of __consumer_offsets (pending offsets)"
    deadline = plane.session.call_deadline(timeout)
    with plane.deadline(deadline.remaining()):
        count = consumer_offsets_partition_count(plane.session)
        if count <= 0:
            return {}
        by_partition: dict[int, set[str]] = {}
        for group_id in group_ids:
            by_partition.setdefault(offsets_partition(group_id, count), set()).add(group_id)
        holders: dict[str, list[int]] = {}
        for partition, groups in sorted(by_partition.items()):
            tp = TopicPartition(CONSUMER_OFFSETS_TOPIC, partition)
            open_here = {p.producer_id: p.current_txn_start_offset
                         for p in plane.describe_producers(tp) if p.current_txn_start_offset >= 0}
            if not open_here:
                continue
            _, _, end = plane.partition_offsets(tp)
            offset, read = min(open_here.values()), 0
            found: dict[str, set[int]] = {g: set() for g in groups}
            while offset < end and read < PENDING_READ_MAX_BYTES:
                data = _fetch(plane, tp, offset, deadline, context)
                if not data:
                    break
                read += len(data)
                records = MemoryRecords(data)
                while (batch := records.next_batch()) is not None:
                    offset = max(offset, batch.next_offset)
                    if batch.producer_id not in open_here or not batch.is_transactional or batch.is_control_batch:
                        continue
                    for record in batch:
                        group = _offset_commit_group(record.key)
                        if group in found:
                            found[group].add(batch.producer_id)
            complete = offset >= end
            for group, pids in found.items():
                chosen = pids if complete or pids else set(open_here)
                if chosen:
                    holders[group] = sorted(chosen)
        return holders


def _fetch(plane: ControlPlane, tp: TopicPartition, offset: int, deadline: Any, context: str) -> bytes:
    """The record bytes of ``tp`` from ``offset`` (one Fetch to its leader, ``READ_UNCOMMITTED``)."""
    from kafka.protocol.consumer.fetch import FetchRequest

    request = FetchRequest(
        replica_id=-1, max_wait_ms=0, min_bytes=0, max_bytes=1 << 20, isolation_level=0, session_id=0,
        session_epoch=-1, forgotten_topics_data=[], rack_id="",
        topics=[FetchRequest.FetchTopic(topic=tp.topic, partitions=[FetchRequest.FetchTopic.FetchPartition(
            partition=tp.partition, current_leader_epoch=-1, fetch_offset=offset, last_fetched_epoch=-1,
            log_start_offset=-1, partition_max_bytes=1 << 20)])],
        min_version=4, max_version=12,
    )

    async def attempt(admin: KafkaAdminClient, leader: int) -> bytes:
        response = await plane.session.send(admin, request, leader, deadline, context)
        for topic in response.responses:
            for partition in topic.partitions:
                check_code(Route.LEADER, int(partition.error_code), context)
                return bytes(partition.records or b"")
        return b""

    return plane.session.on_leader(tp, context, deadline, attempt)
