"""Every partition of the cluster whose last stable offset is below its high watermark, in a few requests.

An open transaction pins a partition's last stable offset (LSO) at its first
record there: ``read_committed`` consumers stop at it.  The coordinators'
view (ListTransactions, DescribeTransactions) finds the partitions of the
transactions they have open, but not a *hanging* one: a transaction the
partition still holds open although no coordinator does (a lost marker,
KIP-664).  Only the partition leaders know those, so the scan asks them:

1. one ``Metadata`` request for every topic: each partition's leader;
2. per leader, two ``ListOffsets`` requests carrying all the partitions it
   leads: the latest offset under ``READ_COMMITTED`` (the LSO), then under
   ``READ_UNCOMMITTED`` (the high watermark).

So a scan costs ``1 + 2 x brokers`` requests whatever the number of
partitions; the answers grow with the partitions (about 30 bytes each).  A
partition whose leader answered with an error (it moved, it is offline) is
asked again on its own, with the leader route's retries.  A record appended
between the two readings can make a partition look held back for a moment:
the caller confirms a held-back partition with ``DescribeProducers`` (a
partition with no producer holding a transaction open is not held back).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from kafka.admin import KafkaAdminClient
from kafka.protocol.consumer.offsets import ListOffsetsRequest

from kafka2pc._control import _protocol as protocol
from kafka2pc._errors import WireError
from kafka2pc._exceptions import KafkaTransactionError
from kafka2pc._types import PartitionLag, TopicPartition

if TYPE_CHECKING:
    from kafka2pc._control._plane import ControlPlane

__all__ = ["held_back_partitions", "leaders"]


async def leaders(plane: ControlPlane, admin: KafkaAdminClient, deadline: Any, context: str,
                  topics: Collection[str] | None) -> dict[TopicPartition, int]:
    """Each partition's leader (``-1``: none now), for every topic or those named."""
    response = await plane.session.send(admin, protocol.metadata(None), None, deadline, context, label="ListTopics")
    found: dict[TopicPartition, int] = {}
    for topic in response.topics:
        name = str(topic.name)
        if topic.error_code or (topics is not None and name not in topics):
            continue
        for partition in topic.partitions:
            found[TopicPartition(name, int(partition.partition_index))] = int(partition.leader_id)
    return found


def _list_offsets(tps: list[TopicPartition], isolation: int) -> Any:
    by_topic: dict[str, list[int]] = defaultdict(list)
    for tp in tps:
        by_topic[tp.topic].append(tp.partition)
    return ListOffsetsRequest(
        replica_id=-1,
        isolation_level=isolation,
        topics=[
            ListOffsetsRequest.ListOffsetsTopic(
                name=topic,
                partitions=[
                    ListOffsetsRequest.ListOffsetsTopic.ListOffsetsPartition(
                        partition_index=p, timestamp=protocol.LATEST_TIMESTAMP
                    )
                    for p in sorted(partitions)
                ],
            )
            for topic, partitions in sorted(by_topic.items())
        ],
        min_version=2,
    )


def _offsets(response: Any) -> tuple[dict[TopicPartition, int], set[TopicPartition]]:
    """``(offset by partition, partitions answered with an error)``."""
    offsets: dict[TopicPartition, int] = {}
    failed: set[TopicPartition] = set()
    for topic in response.topics:
        for partition in topic.partitions:
            tp = TopicPartition(str(topic.name), int(partition.partition_index))
            if partition.error_code == WireError.NONE:
                offsets[tp] = int(partition.offset)
            else:
                failed.add(tp)
    return offsets, failed


def held_back_partitions(
    plane: ControlPlane, *, topics: Collection[str] | None = None, timeout: float | None = None
) -> list[PartitionLag]:
    """Partitions (of every topic, or of ``topics``) whose LSO is below the high watermark, sorted.

    The partitions whose leader answered with an error are asked again one by
    one (``plane.partition_offsets``); a topic deleted meanwhile is skipped.
    """
    context = "Metadata / ListOffsets of every partition"
    deadline = plane.session.call_deadline(timeout)

    async def go(admin: KafkaAdminClient) -> tuple[dict[TopicPartition, tuple[int, int]], set[TopicPartition]]:
        by_leader: dict[int, list[TopicPartition]] = defaultdict(list)
        retry: set[TopicPartition] = set()
        for tp, leader in (await leaders(plane, admin, deadline, context, topics)).items():
            if leader < 0:
                retry.add(tp)
            else:
                by_leader[leader].append(tp)
        pairs: dict[TopicPartition, tuple[int, int]] = {}
        for leader, tps in sorted(by_leader.items()):
            send = plane.session.send
            committed = await send(admin, _list_offsets(tps, protocol.ISOLATION_READ_COMMITTED), leader,
                                   deadline, f"{context} (broker {leader})")
            uncommitted = await send(admin, _list_offsets(tps, protocol.ISOLATION_READ_UNCOMMITTED), leader,
                                     deadline, f"{context} (broker {leader})")
            lso, failed_lso = _offsets(committed)
            hw, failed_hw = _offsets(uncommitted)
            retry |= failed_lso | failed_hw
            for tp in tps:
                if tp in lso and tp in hw:
                    pairs[tp] = (lso[tp], hw[tp])
        return pairs, retry - set(pairs)

    pairs, retry = plane.session.run(context, deadline, go)
    for tp in sorted(retry):
        try:
            _, lso, hw = plane.partition_offsets(tp, timeout=deadline.remaining())
        except KafkaTransactionError as exc:
            if exc.error_code == WireError.UNKNOWN_TOPIC_OR_PARTITION:
                continue  # deleted since the metadata was read: it holds nothing back any more
            raise
        pairs[tp] = (lso, hw)
    return [PartitionLag(tp.topic, tp.partition, lso, hw) for tp, (lso, hw) in sorted(pairs.items()) if lso < hw]

