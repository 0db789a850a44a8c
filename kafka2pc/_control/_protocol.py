"""The transactional wire requests the control plane sends, built with kafka-python's schemas.

Requests are built here and nowhere else, and :data:`RESPONSE_FIELDS` names
every response field the control plane reads, so that
:func:`check_schemas` can tell, without a broker, whether an installed
kafka-python still has them (see :mod:`kafka2pc._control._kafka_python`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kafka.protocol.admin.configs import DescribeConfigsRequest, DescribeConfigsResponse
from kafka.protocol.admin.transactions import (
    DescribeProducersRequest,
    DescribeProducersResponse,
    DescribeTransactionsRequest,
    DescribeTransactionsResponse,
    ListTransactionsRequest,
    ListTransactionsResponse,
)
from kafka.protocol.consumer.offsets import ListOffsetsRequest, ListOffsetsResponse
from kafka.protocol.metadata import (
    CoordinatorType,
    FindCoordinatorRequest,
    FindCoordinatorResponse,
    MetadataRequest,
    MetadataResponse,
)
from kafka.protocol.producer.transaction import (
    EndTxnRequest,
    EndTxnResponse,
    InitProducerIdRequest,
    InitProducerIdResponse,
    WriteTxnMarkersRequest,
)

__all__ = [
    "END_TXN_MAX_TV1_VERSION",
    "INIT_PID_2PC_VERSION",
    "RESPONSE_FIELDS",
    "check_schemas",
    "describe_configs",
    "describe_producers",
    "describe_transactions",
    "end_txn",
    "find_transaction_coordinator",
    "init_producer_id",
    "list_offsets",
    "list_transactions",
    "metadata",
]

# Highest EndTxn version with transaction-version-1 semantics.  v5 (KIP-890
# part 2) makes the coordinator bump the epoch when the transaction completes,
# which a librdkafka (TV1) transaction must not see: the stored
# {producer_id, epoch} would stop matching and a retry would be fenced.
END_TXN_MAX_TV1_VERSION = 4
INIT_PID_2PC_VERSION = 6
ISOLATION_READ_UNCOMMITTED = 0
ISOLATION_READ_COMMITTED = 1
EARLIEST_TIMESTAMP = -2
LATEST_TIMESTAMP = -1
_BROKER_RESOURCE = 4


def find_transaction_coordinator(transactional_id: str) -> Any:
    """FindCoordinator (v0-v3, one key) for a transactional id."""
    return FindCoordinatorRequest(
        key=transactional_id, key_type=CoordinatorType.TRANSACTION.value, max_version=3
    )


def describe_transactions(transactional_id: str) -> Any:
    """DescribeTransactions for one transactional id."""
    return DescribeTransactionsRequest(transactional_ids=[transactional_id])


def describe_producers(topic: str, partition: int) -> Any:
    """DescribeProducers for one partition."""
    return DescribeProducersRequest(
        topics=[DescribeProducersRequest.TopicRequest(name=topic, partition_indexes=[partition])]
    )


def abort_markers(topic: str, partition: int, producer_id: int, producer_epoch: int, coordinator_epoch: int) -> Any:
    """WriteTxnMarkers: one abort marker for ``producer_id``'s open transaction on one partition."""
    marker = WriteTxnMarkersRequest.WritableTxnMarker(
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        transaction_result=False,
        topics=[
            WriteTxnMarkersRequest.WritableTxnMarker.WritableTxnMarkerTopic(
                name=topic, partition_indexes=[partition]
            )
        ],
        coordinator_epoch=coordinator_epoch,
    )
    return WriteTxnMarkersRequest(markers=[marker])


def list_transactions(states: Collection[str], min_duration_ms: int | None) -> Any:
    """ListTransactions, filtered by state and (v1+, Kafka 3.8) by minimum duration."""
    kwargs: dict[str, Any] = {"state_filters": list(states), "producer_id_filters": []}
    if min_duration_ms is not None:
        kwargs.update(duration_filter=int(min_duration_ms), min_version=1)
    return ListTransactionsRequest(**kwargs)


def end_txn(transactional_id: str, producer_id: int, producer_epoch: int, *, commit: bool) -> Any:
    """EndTxn, at most v4 (transaction version 1 semantics, see :data:`END_TXN_MAX_TV1_VERSION`)."""
    return EndTxnRequest(
        transactional_id=transactional_id,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        committed=commit,
        max_version=END_TXN_MAX_TV1_VERSION,
    )


def init_producer_id(
    transactional_id: str, *, transaction_timeout_ms: int, keep_prepared_txn: bool, enable_2pc: bool
) -> Any:
    """InitProducerId; v6 exactly when a KIP-939 field is set, below v6 otherwise."""
    kwargs: dict[str, Any] = {
        "transactional_id": transactional_id,
        "transaction_timeout_ms": int(transaction_timeout_ms),
    }
    if keep_prepared_txn or enable_2pc:
        kwargs.update(
            keep_prepared_txn=keep_prepared_txn, enable2_pc=enable_2pc, min_version=INIT_PID_2PC_VERSION
        )
    else:
        kwargs["max_version"] = INIT_PID_2PC_VERSION - 1
    return InitProducerIdRequest(**kwargs)


def list_offsets(topic: str, partition: int, timestamp: int, isolation: int) -> Any:
    """ListOffsets (v2+, which carries the isolation level) for one partition."""
    return ListOffsetsRequest(
        replica_id=-1,
        isolation_level=isolation,
        topics=[
            ListOffsetsRequest.ListOffsetsTopic(
                name=topic,
                partitions=[
                    ListOffsetsRequest.ListOffsetsTopic.ListOffsetsPartition(
                        partition_index=partition, timestamp=timestamp
                    )
                ],
            )
        ],
        min_version=2,
    )


def metadata(topic: str | None) -> Any:
    """Metadata for one topic, or (``None``) for every topic; never creates a topic."""
    if topic is None:
        return MetadataRequest(topics=None, allow_auto_topic_creation=False)
    return MetadataRequest(
        topics=[MetadataRequest.MetadataRequestTopic(name=topic)], allow_auto_topic_creation=False
    )


def describe_configs(broker_id: int, names: Collection[str]) -> Any:
    """DescribeConfigs of one broker, for the named settings."""
    resource = DescribeConfigsRequest.DescribeConfigsResource(
        resource_type=_BROKER_RESOURCE, resource_name=str(broker_id), configuration_keys=list(names)
    )
    return DescribeConfigsRequest(resources=[resource])


# Response class -> dotted paths of every field the control plane reads.
RESPONSE_FIELDS: dict[Any, tuple[str, ...]] = {
    FindCoordinatorResponse: ("error_code", "node_id", "host", "port"),
    DescribeTransactionsResponse: (
        "transaction_states.error_code",
        "transaction_states.transactional_id",
        "transaction_states.transaction_state",
        "transaction_states.transaction_timeout_ms",
        "transaction_states.transaction_start_time_ms",
        "transaction_states.producer_id",
        "transaction_states.producer_epoch",
        "transaction_states.topics.topic",
        "transaction_states.topics.partitions",
    ),
    DescribeProducersResponse: (
        "topics.name",
        "topics.partitions.partition_index",
        "topics.partitions.error_code",
        "topics.partitions.active_producers.producer_id",
        "topics.partitions.active_producers.producer_epoch",
        "topics.partitions.active_producers.last_sequence",
        "topics.partitions.active_producers.last_timestamp",
        "topics.partitions.active_producers.coordinator_epoch",
        "topics.partitions.active_producers.current_txn_start_offset",
    ),
    ListTransactionsResponse: (
        "error_code",
        "transaction_states.transactional_id",
        "transaction_states.producer_id",
        "transaction_states.transaction_state",
    ),
    EndTxnResponse: ("error_code",),
    InitProducerIdResponse: (
        "error_code",
        "producer_id",
        "producer_epoch",
        "ongoing_txn_producer_id",
        "ongoing_txn_producer_epoch",
    ),
    ListOffsetsResponse: ("topics.partitions.error_code", "topics.partitions.offset"),
    MetadataResponse: (
        "topics.name",
        "topics.error_code",
        "topics.partitions.partition_index",
        "topics.partitions.leader_id",
    ),
    DescribeConfigsResponse: ("results.error_code", "results.configs.name", "results.configs.value"),
}


def _sample_requests() -> list[tuple[str, Any, int]]:
    """``(description, request, version to encode at)`` for every request shape sent."""
    return [
        ("FindCoordinator v3", find_transaction_coordinator("tx"), 3),
        ("DescribeTransactions v0", describe_transactions("tx"), 0),
        ("DescribeProducers v0", describe_producers("t", 0), 0),
        ("ListTransactions v1", list_transactions(["Ongoing"], 1000), 1),
        ("EndTxn v4", end_txn("tx", 1, 0, commit=True), END_TXN_MAX_TV1_VERSION),
        ("InitProducerId v5", init_producer_id(
            "tx", transaction_timeout_ms=1000, keep_prepared_txn=False, enable_2pc=False), 5),
        ("InitProducerId v6 (KIP-939)", init_producer_id(
            "tx", transaction_timeout_ms=1000, keep_prepared_txn=True, enable_2pc=True), INIT_PID_2PC_VERSION),
        ("ListOffsets v2", list_offsets("t", 0, LATEST_TIMESTAMP, ISOLATION_READ_COMMITTED), 2),
        ("Metadata v4 (one topic)", metadata("t"), 4),
        ("Metadata v4 (all topics)", metadata(None), 4),
        ("DescribeConfigs v1", describe_configs(1, ["transaction.max.timeout.ms"]), 1),
    ]


def check_schemas() -> list[str]:
    """Problems with the request and response schemas of the installed kafka-python (empty: none)."""
    problems: list[str] = []
    try:
        samples = _sample_requests()
    except Exception as exc:  # noqa: BLE001 - any failure here is the finding
        return [f"building the control plane's requests failed: {exc!r}"]
    for description, request, version in samples:
        try:
            request.encode(version=version)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{description}: cannot be encoded ({exc!r})")
    for response_class, paths in RESPONSE_FIELDS.items():
        for path in paths:
            fields: Any = getattr(response_class, "fields", None)
            for part in path.split("."):
                field = fields.get(part) if isinstance(fields, dict) else None
                if field is None:
                    problems.append(f"{response_class.__name__} has no field {path!r}")
                    break
                fields = getattr(field, "fields", None)
    return problems
