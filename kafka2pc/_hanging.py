"""Hanging transactions: open on a partition, unknown as such to their coordinator (``kafka-transactions.sh``).

A partition keeps a transaction open until it receives its commit or abort
marker.  If the coordinator no longer tracks that transaction (KAFKA-12671:
a marker lost to a bug or a broker failure; a producer id reused...), no
marker will ever come and the partition's last stable offset is pinned:
``read_committed`` consumers stop there.  Apache Kafka's
``kafka-transactions.sh find-hanging`` finds them, ``abort`` writes the
missing marker.  This module holds the same policy, over the control plane's
observations:

1. every producer with an open transaction on the partitions asked about
   (DescribeProducers' ``CurrentTxnStartOffset`` >= 0);
2. of those, the ones whose last write is older than the longest transaction
   timeout the cluster allows (``transaction.max.timeout.ms``, 15 minutes
   unless changed): a live transaction cannot be that old;
3. each is looked up at the coordinators (ListTransactions by producer id,
   then DescribeTransactions): it is *hanging* unless a coordinator has that
   producer id's transaction open with this partition in it.

A prepared two-phase-commit transaction whose owner died is *not* hanging by
this definition: its coordinator still tracks it (and aborts it when its
timeout expires).  Settle those with ``kafka2pc complete`` or ``recover``,
which know the stored decision; ``find-hanging --all-open`` lists them too.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kafka2pc._control import ControlPlane
from kafka2pc._deprecation import deprecated_property
from kafka2pc._exceptions import UsageError
from kafka2pc._logging import with_librdkafka_logger
from kafka2pc._types import OPEN_STATES, ProducerState, TopicAndPartition, TransactionDescription

__all__ = ["OpenTransaction", "find_open_transactions", "judge", "partitions"]




@dataclass(frozen=True)
class OpenTransaction:
    """One producer's open transaction on one partition, and what its coordinator says of it."""

    partition: TopicAndPartition
    producer: ProducerState
    duration_s: float
    """Seconds since the producer last wrote to the partition."""
    transactional_id: str | None
    """The transactional id a coordinator lists for the producer id (``None``: none does)."""
    coordinator_state: str | None
    hanging: bool
    reason: str

    duration_ms = deprecated_property("duration_ms", "duration_s", lambda self: round(self.duration_s * 1000))


def judge(
    tp: TopicAndPartition,
    producer: ProducerState,
    transactional_ids: Sequence[str],
    descriptions: Mapping[str, TransactionDescription | None],
) -> tuple[bool, str, str | None, str | None]:
    """Is ``producer``'s open transaction on ``tp`` hanging?  ``(hanging, reason, transactional id, state)``.

    ``transactional_ids`` are the ids the coordinators list for the producer
    id; ``descriptions`` their DescribeTransactions answers.
    """
    if not transactional_ids:
        return True, "no coordinator has a transactional id with this producer id", None, None
    for tid in transactional_ids:
        desc = descriptions.get(tid)
        if desc is None or desc.producer_id != producer.producer_id:
            continue
        if desc.state in OPEN_STATES and tp in desc.partitions:
            reason = f"open at its coordinator ({desc.state}); it aborts it when its timeout expires"
            return False, reason, tid, desc.state
        return (
            True,
            f"its coordinator has {tid!r} in state {desc.state} without this partition",
            tid,
            desc.state,
        )
    return True, "the coordinator now has another producer id for its transactional id", transactional_ids[0], None


def find_open_transactions(
    ctrl: ControlPlane,
    tps: Iterable[TopicAndPartition],
    *,
    max_transaction_timeout_ms: int,
    now_ms: int | None = None,
) -> list[OpenTransaction]:
    """Open transactions on ``tps`` older than ``max_transaction_timeout_ms``, each judged hanging or not.

    ``max_transaction_timeout_ms``: the broker's ``transaction.max.timeout.ms``
    (:attr:`kafka2pc.TransactionAdmin.DEFAULT_MAX_TRANSACTION_TIMEOUT_MS` when
    the caller cannot ask it).
    """
    now = int(time.time() * 1000) if now_ms is None else now_ms
    candidates: list[tuple[TopicAndPartition, ProducerState]] = []
    for tp in tps:
        for producer in ctrl.describe_producers(tp):
            if producer.current_txn_start_offset < 0:
                continue
            if now - producer.last_timestamp_ms < max_transaction_timeout_ms:
                continue
            candidates.append((tp, producer))
    if not candidates:
        return []
    wanted = {p.producer_id for _, p in candidates}
    tids_by_pid: dict[int, list[str]] = {}
    for listing in ctrl.list_transactions():
        if listing.producer_id in wanted:
            tids_by_pid.setdefault(listing.producer_id, []).append(listing.transactional_id)
    descriptions = {tid: ctrl.describe_transaction(tid) for tids in tids_by_pid.values() for tid in tids}
    found = []
    for tp, producer in candidates:
        hanging, reason, tid, state = judge(tp, producer, tids_by_pid.get(producer.producer_id, []), descriptions)
        age_ms = max(0, now - producer.last_timestamp_ms)
        found.append(OpenTransaction(tp, producer, age_ms / 1000, tid, state, hanging, reason))
    return sorted(found, key=lambda o: (o.partition, o.producer.producer_id))


def partitions(
    config: Mapping[str, Any],
    *,
    topic: str | None = None,
    partition: int | None = None,
    broker_id: int | None = None,
    timeout_s: float = 15.0,
) -> list[TopicAndPartition]:
    """The partitions of ``topic`` (or only ``partition``), or those led by ``broker_id``, from metadata.

    Uses a confluent-kafka admin client for the cluster metadata (partitions
    and leaders of every topic).
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    if (topic is None) == (broker_id is None):
        raise UsageError("give either a topic or a broker id")
    admin = AdminClient(with_librdkafka_logger(dict(config)))
    try:
        metadata = admin.list_topics(topic=topic, timeout=timeout_s)
    except KafkaException as exc:
        from kafka2pc._errors import translate_confluent_error

        raise translate_confluent_error(exc, "Metadata") from exc
    result = []
    for name, meta in metadata.topics.items():
        if topic is not None and name != topic:
            continue
        if meta.error is not None:
            if meta.error.code() == meta.error.UNKNOWN_TOPIC_OR_PART:
                raise UsageError(f"unknown topic {name!r}")
            from kafka2pc._errors import translate_confluent_error

            raise translate_confluent_error(meta.error, f"Metadata for {name!r}")
        for index, part in meta.partitions.items():
            if partition is not None and index != partition:
                continue
            if broker_id is not None and part.leader != broker_id:
                continue
            result.append(TopicAndPartition(name, int(index)))
    if topic is not None and partition is not None and not result:
        raise UsageError(f"topic {topic!r} has no partition {partition}")
    return sorted(result)
