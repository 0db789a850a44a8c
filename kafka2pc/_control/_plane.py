"""``ControlPlane``: requests straight to the transaction coordinator and partition leaders.

What each request means, and what the broker answers, is documented on the
methods.  :class:`ControlPlane` holds two collaborators: a
:class:`~kafka2pc._control._session.Session` (the connection, deadlines,
routing and the request counts) and a
:class:`~kafka2pc._control._completion.Completion` (ending and fencing
transactions, on the same session); it owns only its cached capability
answer.  How a
request is retried is :mod:`._retry`; how it is encoded is :mod:`._protocol`;
kafka-python's internals are in :mod:`._kafka_python`; the ``read_committed``
outcome probe is :mod:`._outcome_probe`.  This module decides nothing about recovery (what
to commit, when): that is the core's policy.

Every call is bounded by a deadline: the ``timeout`` given to the call, else
the innermost :meth:`ControlPlane.deadline` block in the calling thread, else
the plane's ``timeout_s`` (30 s by default).  Nested bounds only shorten it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from contextlib import AbstractContextManager
from typing import Any

import kafka.errors as kafka_errors
from kafka.admin import KafkaAdminClient

from kafka2pc._control import _kafka_python as compat
from kafka2pc._control import _protocol as protocol
from kafka2pc._control._completion import (
    DEFAULT_FENCE_TRANSACTION_TIMEOUT_MS,
    Completion,
    fence_transaction_timeout_ms,
)
from kafka2pc._control._outcome_probe import read_committed_outcome
from kafka2pc._control._retry import Deadline, Route, check_code
from kafka2pc._control._session import (
    DEFAULT_CONTROL_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    Session,
    on_topic,
    on_txn_id,
)
from kafka2pc._errors import WireError, translate_kafka_python_error
from kafka2pc._exceptions import (
    UnsupportedBrokerError,
    UsageError,
)
from kafka2pc._types import (
    InitProducerIdResult,
    ProducerState,
    TopicPartition,
    TransactionDescription,
    TransactionListing,
)

__all__ = [
    "DEFAULT_CONTROL_TIMEOUT_S",
    "DEFAULT_FENCE_TRANSACTION_TIMEOUT_MS",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "ControlPlane",
    "fence_transaction_timeout_ms",
]

log = logging.getLogger(__name__)

_PROBE_TRANSACTIONAL_ID = "kafka2pc-capability-probe"
_ON_CLUSTER = "DESCRIBE_CONFIGS on the Cluster"


class ControlPlane:
    """A client for the transaction coordinator and partition leaders.

    Construct it with the same confluent-kafka style config as the producer
    (only the connection and security settings are used).  It connects on the
    first call, so constructing one is cheap; close it (or use ``with``) when
    done.  Every call is bounded (see the module docstring): each request
    waits at most ``request_timeout_s``, retriable wire errors are retried at
    most ``max_retries`` times with exponential backoff, and the whole call
    finishes within its ``timeout`` (default ``timeout_s``) plus a little slack
    (the time to notice an expired deadline: milliseconds).

    >>> with ControlPlane({"bootstrap.servers": "localhost:9092"}) as cp:  # doctest: +SKIP
    ...     cp.describe_transaction("orders-tx-1", timeout=5)
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        max_retries: int = 20,
        timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
    ) -> None:
        self._session = Session(
            config, request_timeout_s=request_timeout_s, max_retries=max_retries, timeout_s=timeout_s
        )
        self._completion = Completion(self._session)
        self._keep_prepared_supported: bool | None = None

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the connection (the session's) -----------------------------------------

    @property
    def session(self) -> Session:
        """The connection every call of this plane goes through (for kafka2pc's own request modules)."""
        return self._session

    @property
    def timeout_s(self) -> float:
        """The bound of a call given no ``timeout`` (outside any :meth:`deadline` block)."""
        return self._session.timeout_s

    def close(self) -> None:
        """Close the connections (idempotent)."""
        self._session.close()

    def deadline(self, timeout_s: float | None) -> AbstractContextManager[Deadline]:
        """Bound every call made by this thread inside the block to end within ``timeout_s`` from now.

        ``None`` means the plane's ``timeout_s``.  A block inside another, or a
        call's own ``timeout``, can only make the bound earlier.  This is how
        a caller that makes several calls (recovery: describe, then
        DescribeProducers, then EndTxn...) holds all of them to one timeout.
        """
        return self._session.deadline(timeout_s)

    @property
    def requests_sent(self) -> dict[str, int]:
        """Requests sent so far by API name (``{"EndTxn": 1, ...}``), a copy.

        Counts what kafka2pc itself asks of the cluster (not kafka-python's
        connection bootstrap or its periodic metadata refresh); a
        ``record_outcome`` read_committed probe counts as ``"OutcomeProbe"`` and
        a topic listing as ``"ListTopics"``.  Lets tests and benchmarks check that a producer's steady-state
        transactions cost no control-plane round trip.
        """
        return self._session.requests_sent

    def wire_requests_written(self) -> int:
        """Every request written on the control plane's connections so far, kafka-python's own included.

        Unlike :attr:`requests_sent` this counts the client's bootstrap and
        its periodic metadata refresh too (``0`` before the first call).
        Benchmarks use it to show the steady state costs no round trip at all.
        """
        return self._session.wire_requests_written()

    # -- ending and fencing (the completion's) ------------------------------------

    def end_txn(
        self,
        transactional_id: str,
        producer_id: int,
        producer_epoch: int,
        *,
        commit: bool,
        timeout: float | None = None,
    ) -> None:
        """Commit or abort the transaction open under ``{producer_id, epoch}`` (EndTxn, at most v4).

        See :meth:`~kafka2pc._control._completion.Completion.end_txn` for what
        each answer means: a retry of the same decision succeeds, the opposite
        one after completion raises :class:`HeuristicOutcomeError`, no answer
        in time raises :class:`IndefiniteOutcomeError`.
        """
        self._completion.end_txn(transactional_id, producer_id, producer_epoch, commit=commit, timeout=timeout)

    def init_producer_id(
        self,
        transactional_id: str,
        *,
        transaction_timeout_ms: int,
        keep_prepared_txn: bool = False,
        enable_2pc: bool = False,
        timeout: float | None = None,
    ) -> InitProducerIdResult:
        """InitProducerId for ``transactional_id`` (KIP-939 fields when asked).

        Without ``keep_prepared_txn`` it is KIP-939's ``forceTerminateTransaction``:
        the coordinator aborts any open transaction and bumps the epoch.  See
        :meth:`~kafka2pc._control._completion.Completion.init_producer_id`.
        """
        return self._completion.init_producer_id(
            transactional_id, transaction_timeout_ms=transaction_timeout_ms, keep_prepared_txn=keep_prepared_txn,
            enable_2pc=enable_2pc, timeout=timeout,
        )

    def fence(
        self,
        transactional_id: str,
        description: TransactionDescription | None = None,
        *,
        timeout: float | None = None,
    ) -> InitProducerIdResult:
        """Abort whatever is open under ``transactional_id`` and bump its epoch (fences old instances).

        InitProducerId without KIP-939 fields, with the transaction timeout
        :func:`fence_transaction_timeout_ms` picks from ``description``.
        """
        return self._completion.fence(transactional_id, description, timeout=timeout)


    # -- metadata --------------------------------------------------------------

    def api_versions(self, *, timeout: float | None = None) -> dict[str, tuple[int, int]]:
        """API name -> ``(min, max)`` version the bootstrap broker advertises.

        Capabilities are detected from this (and probes), never from version
        strings.  Unknown API keys are named by number.
        """
        context = "ApiVersions"
        admin = self._session.client(self._session.call_deadline(timeout), context)
        versions = compat.advertised_api_versions(admin)
        if versions is None:
            raise translate_kafka_python_error(
                kafka_errors.NodeNotReadyError("no ApiVersions answer from the cluster yet"), context
            )
        return {compat.api_key_name(key): low_high for key, low_high in sorted(versions.items())}

    def broker_config(self, names: Collection[str], *, timeout: float | None = None) -> dict[str, str]:
        """Values of broker settings (DescribeConfigs on one live broker).

        Used to check ``transaction.max.timeout.ms`` and
        ``transaction.two.phase.commit.enable`` before relying on them.  Names
        the broker does not know, and sensitive values (reported as null),
        are absent from the result.  A broker that is down or does not answer
        is left for the next one (retried as every control-plane call is,
        within the call's deadline).
        """
        wanted = list(names)
        context = "DescribeConfigs"
        deadline = self._session.call_deadline(timeout)

        async def attempt(admin: KafkaAdminClient, node_id: int, cap_ms: int) -> dict[str, str]:
            response = await self._session.send(admin, protocol.describe_configs(node_id, wanted), node_id, deadline,
                                        context, cap_ms=cap_ms)
            values: dict[str, str] = {}
            for result in response.results:
                if result.error_code:
                    raise translate_kafka_python_error(
                        result.error_code, f"DescribeConfigs on broker {node_id}", needs=_ON_CLUSTER
                    )
                for entry in result.configs:
                    if entry.value is not None:
                        values[entry.name] = entry.value
            return values

        return self._session.on_any_broker(context, deadline, attempt)

    def topic_names(self, *, timeout: float | None = None) -> list[str]:
        """Names of every topic in the cluster (used to resolve digest-stored anchor topics)."""
        context = "listing topics"
        deadline = self._session.call_deadline(timeout)

        async def go(admin: KafkaAdminClient) -> list[str]:
            response = await self._session.send(admin, protocol.metadata(None), None, deadline, context,
                                                label="ListTopics")
            return sorted(str(topic.name) for topic in response.topics if not topic.error_code)

        return self._session.run(context, deadline, go)

    # -- transactions ----------------------------------------------------------

    def describe_transaction(
        self, transactional_id: str, *, timeout: float | None = None
    ) -> TransactionDescription | None:
        """What the coordinator knows about ``transactional_id``; ``None`` if nothing.

        ``None`` means TRANSACTIONAL_ID_NOT_FOUND: the id never initialised a
        producer, or it expired (``transactional.id.expiration.ms``).
        """
        context = f"DescribeTransactions for {transactional_id!r}"
        deadline = self._session.call_deadline(timeout)

        async def attempt(admin: KafkaAdminClient, coordinator: int) -> TransactionDescription | None:
            response = await self._session.send(
                admin, protocol.describe_transactions(transactional_id), coordinator, deadline, context
            )
            for txn in response.transaction_states:
                if txn.transactional_id != transactional_id:
                    continue
                if txn.error_code == WireError.TRANSACTIONAL_ID_NOT_FOUND:
                    return None
                check_code(Route.COORDINATOR, int(txn.error_code), context,
                           needs=on_txn_id("DESCRIBE", transactional_id))
                partitions = tuple(
                    sorted(TopicPartition(topic.topic, int(p)) for topic in txn.topics for p in topic.partitions)
                )
                return TransactionDescription(
                    transactional_id=transactional_id,
                    state=str(txn.transaction_state),
                    producer_id=int(txn.producer_id),
                    producer_epoch=int(txn.producer_epoch),
                    timeout_ms=int(txn.transaction_timeout_ms),
                    start_time_ms=int(txn.transaction_start_time_ms),
                    partitions=partitions,
                    coordinator_id=coordinator,
                )
            raise translate_kafka_python_error(
                kafka_errors.KafkaProtocolError("no entry for the transactional id in the answer"), context
            )

        return self._session.on_coordinator(transactional_id, context, deadline, attempt)

    def describe_producers(self, tp: TopicPartition, *, timeout: float | None = None) -> list[ProducerState]:
        """Active producers on ``tp``, asked of the partition leader.

        The row of a producer with an open transaction carries the offset of
        that transaction's first record on ``tp`` (``current_txn_start_offset``).
        """
        context = f"DescribeProducers for {tp.topic}-{tp.partition}"
        deadline = self._session.call_deadline(timeout)

        async def attempt(admin: KafkaAdminClient, leader: int) -> list[ProducerState]:
            response = await self._session.send(admin, protocol.describe_producers(tp.topic, tp.partition), leader,
                                        deadline, context)
            for topic in response.topics:
                for partition in topic.partitions:
                    if topic.name != tp.topic or partition.partition_index != tp.partition:
                        continue
                    check_code(Route.LEADER, int(partition.error_code), context, needs=on_topic("READ", tp.topic))
                    return [
                        ProducerState(
                            producer_id=int(p.producer_id),
                            producer_epoch=int(p.producer_epoch),
                            last_sequence=int(p.last_sequence),
                            last_timestamp_ms=int(p.last_timestamp),
                            coordinator_epoch=int(p.coordinator_epoch),
                            current_txn_start_offset=int(p.current_txn_start_offset),
                        )
                        for p in partition.active_producers
                    ]
            raise translate_kafka_python_error(
                kafka_errors.KafkaProtocolError("no entry for the partition in the answer"), context
            )

        return self._session.on_leader(tp, context, deadline, attempt)

    def abort_partition_transaction(
        self,
        tp: TopicPartition,
        producer_id: int,
        producer_epoch: int,
        *,
        coordinator_epoch: int = -1,
        timeout: float | None = None,
    ) -> None:
        """Write an abort marker for ``producer_id``'s open transaction on ``tp`` (WriteTxnMarkers).

        Kafka's admin ``abortTransaction`` (``kafka-transactions.sh abort``),
        for a *hanging* transaction: one a partition still holds open although
        its coordinator does not (KAFKA-12671), which pins the partition's
        last stable offset forever.  Sent to the partition leader, which checks
        the producer id and epoch; ``coordinator_epoch=-1`` skips the
        coordinator-epoch check, as the Java admin client does.  The
        coordinator is not told: aborting a transaction it still tracks
        leaves it to abort again when its timeout expires.  Needs
        ClusterAction on the Cluster.
        """
        context = f"WriteTxnMarkers (abort) for producer {producer_id}/{producer_epoch} on {tp.topic}-{tp.partition}"
        deadline = self._session.call_deadline(timeout)
        request = protocol.abort_markers(tp.topic, tp.partition, producer_id, producer_epoch, coordinator_epoch)

        async def attempt(admin: KafkaAdminClient, leader: int) -> None:
            response = await self._session.send(admin, request, leader, deadline, context)
            for result in response.markers:
                for topic in result.topics:
                    for partition in topic.partitions:
                        check_code(Route.LEADER, int(partition.error_code), context,
                                   needs="CLUSTER_ACTION on the Cluster")

        self._session.on_leader(tp, context, deadline, attempt)
        log.warning("%s: done", context)

    def list_transactions(
        self, *, states: Collection[str] = (), min_duration_ms: int | None = None, timeout: float | None = None
    ) -> list[TransactionListing]:
        """Transactions known to every broker's coordinator, optionally filtered.

        Each broker coordinates a slice of ``__transaction_state``, so every
        broker is asked.  ``min_duration_ms`` needs ListTransactions v1
        (Kafka 3.8+); an older broker raises :class:`UnsupportedBrokerError`.
        """
        context = "ListTransactions"
        deadline = self._session.call_deadline(timeout)

        async def go(admin: KafkaAdminClient) -> list[TransactionListing]:
            listings: list[TransactionListing] = []
            for node_id in compat.broker_ids(admin):
                request = protocol.list_transactions(states, min_duration_ms)
                response = await self._session.send(admin, request, node_id, deadline, context)
                if response.error_code:
                    raise translate_kafka_python_error(response.error_code, f"{context} on broker {node_id}")
                listings.extend(
                    TransactionListing(
                        transactional_id=str(t.transactional_id),
                        producer_id=int(t.producer_id),
                        state=str(t.transaction_state),
                    )
                    for t in response.transaction_states
                )
            return sorted(listings, key=lambda t: t.transactional_id)

        return self._session.run(context, deadline, go)

    def supports_keep_prepared_txn(self, *, timeout: float | None = None) -> bool:
        """Can the cluster keep a prepared transaction across a restart (KIP-939)?

        First ApiVersions: without InitProducerId v6 the answer is no.  Then a
        probe: InitProducerId v6 with ``KeepPreparedTxn=true`` and
        ``Enable2Pc=true`` for the transactional id
        ``kafka2pc-capability-probe``, which never has an open transaction, so
        the probe cannot abort anything; its only trace is that id's entry in
        ``__transaction_state`` (and it needs WRITE on that id).  Coordinators
        that refuse (all releases through 4.3.x) answer UNSUPPORTED_VERSION.
        The answer is cached for the life of this object.
        """
        if self._keep_prepared_supported is not None:
            return self._keep_prepared_supported
        with self.deadline(timeout):
            low_high = self.api_versions().get("InitProducerId")
            supported = False
            if low_high is not None and low_high[1] >= protocol.INIT_PID_2PC_VERSION:
                try:
                    self.init_producer_id(
                        _PROBE_TRANSACTIONAL_ID,
                        transaction_timeout_ms=60_000,
                        keep_prepared_txn=True,
                        enable_2pc=True,
                    )
                    supported = True
                except UnsupportedBrokerError as exc:
                    log.info("KIP-939 keepPreparedTxn probe refused: %s", exc)
        self._keep_prepared_supported = supported
        return supported

    # -- outcome of one record ---------------------------------------------------

    def record_outcome(self, tp: TopicPartition, offset: int, *, timeout: float | None = None) -> str:
        """Was the record at ``tp``/``offset`` committed, aborted, or is it undecided?

        Returns ``"committed"``, ``"aborted"``, ``"ongoing"`` (the last stable
        offset is not past it yet: its transaction is still open) or
        ``"unknown"`` (below the log start offset: deleted by retention).

        Two steps.  The log start offset and the last stable offset (LSO) come
        from ListOffsets with READ_COMMITTED isolation, sent to the leader:
        exact protocol semantics, no consumer needed for the common
        "ongoing"/"unknown" answers.  Below the LSO every transaction is
        decided, and a short-lived ``read_committed`` librdkafka consumer
        answers (see :mod:`kafka2pc._control._outcome_probe`).  Records
        removed by compaction would read as aborted; use this on topics with
        ``cleanup.policy=delete``.  The whole call is bounded by its deadline;
        without an answer in time, :class:`BrokerUnavailableError` is raised.
        """
        if offset < 0:
            raise UsageError(f"offset must be >= 0, got {offset}")
        context = f"record outcome of {tp.topic}-{tp.partition}@{offset}"
        with self.deadline(timeout) as deadline:
            log_start, lso, _ = self._offset_triple(tp, context, deadline, high_watermark=False)
            if offset < log_start:
                log.info("%s: below log start offset %d -> unknown", context, log_start)
                return "unknown"
            if lso <= offset:
                log.info("%s: last stable offset %d not past it -> ongoing", context, lso)
                return "ongoing"
            self._session.count("OutcomeProbe")
            outcome = read_committed_outcome(self._session.librdkafka, tp, offset, deadline, context)
        log.info("%s: %s (log start %d, LSO %d)", context, outcome, log_start, lso)
        return outcome

    def partition_offsets(self, tp: TopicPartition, *, timeout: float | None = None) -> tuple[int, int, int]:
        """``(log_start_offset, last_stable_offset, high_watermark)`` of ``tp``.

        ``high_watermark - last_stable_offset`` is how many records an open
        transaction holds back from ``read_committed`` consumers.
        """
        context = f"offsets of {tp.topic}-{tp.partition}"
        return self._offset_triple(tp, context, self._session.call_deadline(timeout), high_watermark=True)

    def _offset_triple(
        self, tp: TopicPartition, context: str, deadline: Deadline, *, high_watermark: bool
    ) -> tuple[int, int, int]:
        async def list_offset(admin: KafkaAdminClient, leader: int, timestamp: int, isolation: int) -> int:
            request = protocol.list_offsets(tp.topic, tp.partition, timestamp, isolation)
            response = await self._session.send(admin, request, leader, deadline, context)
            for topic in response.topics:
                for partition in topic.partitions:
                    check_code(Route.LEADER, int(partition.error_code), context, needs=on_topic("DESCRIBE", tp.topic))
                    return int(partition.offset)
            raise translate_kafka_python_error(
                kafka_errors.KafkaProtocolError("no entry for the partition in the answer"), context
            )

        async def attempt(admin: KafkaAdminClient, leader: int) -> tuple[int, int, int]:
            committed = protocol.ISOLATION_READ_COMMITTED
            return (
                await list_offset(admin, leader, protocol.EARLIEST_TIMESTAMP, committed),
                await list_offset(admin, leader, protocol.LATEST_TIMESTAMP, committed),
                await list_offset(admin, leader, protocol.LATEST_TIMESTAMP, protocol.ISOLATION_READ_UNCOMMITTED)
                if high_watermark
                else -1,
            )

        return self._session.on_leader(tp, context, deadline, attempt)
