"""The control plane: requests straight to the transaction coordinator.

confluent-kafka (librdkafka) has no KIP-939 API, does not expose the producer
id and epoch, and its ``init_transactions()`` always aborts an open
transaction.  Completing a prepared transaction after a crash therefore needs
a second client that speaks the transactional wire APIs itself:
FindCoordinator, DescribeTransactions, DescribeProducers, ListTransactions,
EndTxn and InitProducerId.  This module is that client, built on kafka-python
3.0's connection manager and message schemas; it holds no policy (what to
commit, when) — that lives in the core.

Facts this module relies on, each observed against Apache Kafka 4.3.1 (KRaft,
``transaction.version`` finalized at 2) and librdkafka 2.x (see the tests in
``tests/control``):

* librdkafka runs transaction version 1: consecutive transactions of one
  producer share ``{producer_id, epoch}``; the anchor offset
  (DescribeProducers' ``CurrentTxnStartOffset``) is what tells them apart.
* EndTxn v5+ switches the coordinator to TV2 semantics (it bumps the epoch on
  completion and answers with the new one), so :meth:`ControlPlane.end_txn`
  never sends more than v4.
* InitProducerId v6 (KIP-939 ``Enable2Pc``/``KeepPreparedTxn``) is marked
  unstable in 4.3.1: the broker does not advertise it and closes the
  connection if it is sent.  With ``unstable.api.versions.enable=true`` the
  coordinator answers ``KeepPreparedTxn=true`` with UNSUPPORTED_VERSION and
  leaves the ongoing transaction untouched.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, TypeVar

import kafka.errors as kafka_errors
from kafka.admin import KafkaAdminClient
from kafka.protocol.admin.configs import DescribeConfigsRequest
from kafka.protocol.admin.transactions import (
    DescribeProducersRequest,
    DescribeTransactionsRequest,
    ListTransactionsRequest,
)
from kafka.protocol.api_key import ApiKey
from kafka.protocol.consumer.offsets import ListOffsetsRequest
from kafka.protocol.metadata import (
    CoordinatorType,
    FindCoordinatorRequest,
    MetadataRequest,
)
from kafka.protocol.producer.transaction import EndTxnRequest, InitProducerIdRequest, WriteTxnMarkersRequest

from kafka2pc._errors import error_name_for_code, translate_kafka_python_error
from kafka2pc._exceptions import (
    BrokerUnavailableError,
    HeuristicOutcomeError,
    IndefiniteOutcomeError,
    Kafka2pcError,
    UnsupportedBrokerError,
    UsageError,
)
from kafka2pc._logging import quiet_kafka_python, with_librdkafka_logger
from kafka2pc._types import (
    InitProducerIdResult,
    ProducerState,
    TopicPartition,
    TransactionDescription,
    TransactionListing,
)

__all__ = ["ControlPlane", "kafka_python_config"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# ---------------------------------------------------------------------------
# Configuration mapping
# ---------------------------------------------------------------------------

_SECURITY_PREFIXES = ("security.", "sasl.", "ssl.", "enable.ssl.")
_SECURITY_EXACT = frozenset({"oauth_cb", "ssl_key"})
_SECURITY_PROTOCOLS = frozenset({"PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"})
_SASL_MECHANISMS = frozenset({"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI"})
# confluent key -> kafka-python key, values copied as strings.
_DIRECT_KEYS = {
    "client.id": "client_id",
    "sasl.username": "sasl_plain_username",
    "sasl.password": "sasl_plain_password",
    "sasl.kerberos.service.name": "sasl_kerberos_service_name",
    "ssl.ca.location": "ssl_cafile",
    "ssl.certificate.location": "ssl_certfile",
    "ssl.key.location": "ssl_keyfile",
    "ssl.key.password": "ssl_password",
    "ssl.crl.location": "ssl_crlfile",
}


def _is_security_key(key: str) -> bool:
    return key.startswith(_SECURITY_PREFIXES) or key in _SECURITY_EXACT


def kafka_python_config(confluent_config: Mapping[str, Any]) -> dict[str, Any]:
    """Derive kafka-python connection settings from a confluent-kafka config.

    Users configure kafka2pc once, in confluent-kafka's (librdkafka's) dialect;
    the control plane must reach the same cluster with the same identity.
    Only connection settings are mapped.  Producer/consumer-only keys
    (``transactional.id``, ``acks``, ``linger.ms``...) are ignored (logged at
    debug level).  A *security* key this function cannot map raises
    :class:`UsageError` naming it: connecting with weaker or different
    security than the user asked for must never happen silently.

    >>> kafka_python_config({"bootstrap.servers": "a:9092,b:9092"})
    {'bootstrap_servers': ['a:9092', 'b:9092']}
    """
    result: dict[str, Any] = {}
    bootstrap = confluent_config.get("bootstrap.servers") or confluent_config.get(
        "metadata.broker.list"
    )
    if not bootstrap or not isinstance(bootstrap, str):
        raise UsageError("config needs 'bootstrap.servers' (a comma-separated host:port list)")
    servers = [s.strip() for s in bootstrap.split(",") if s.strip()]
    if not servers:
        raise UsageError("'bootstrap.servers' is empty")
    result["bootstrap_servers"] = servers

    for key, value in confluent_config.items():
        if key in ("bootstrap.servers", "metadata.broker.list"):
            continue
        if key in _DIRECT_KEYS:
            if value is not None:
                result[_DIRECT_KEYS[key]] = str(value)
        elif key == "security.protocol":
            protocol = str(value).upper()
            if protocol not in _SECURITY_PROTOCOLS:
                raise UsageError(f"unsupported security.protocol {value!r}")
            result["security_protocol"] = protocol
        elif key in ("sasl.mechanism", "sasl.mechanisms"):
            mechanism = str(value).upper()
            if mechanism not in _SASL_MECHANISMS:
                raise UsageError(
                    f"{key}={value!r} cannot be used by kafka2pc's control plane "
                    f"(supported: {', '.join(sorted(_SASL_MECHANISMS))})"
                )
            result["sasl_mechanism"] = mechanism
        elif key == "ssl.endpoint.identification.algorithm":
            algorithm = str(value).lower()
            if algorithm not in ("https", "none"):
                raise UsageError(f"unsupported ssl.endpoint.identification.algorithm {value!r}")
            result["ssl_check_hostname"] = algorithm == "https"
        elif _is_security_key(key):
            raise UsageError(
                f"security setting {key!r} cannot be mapped to the control plane's "
                "kafka-python connection; use the *.location file settings instead"
            )
        else:
            log.debug("control plane ignores non-connection setting %r", key)

    if result.get("ssl_cafile") == "probe":  # librdkafka: use the system CA store
        del result["ssl_cafile"]
    if "sasl_mechanism" in result and not result.get("security_protocol", "").startswith("SASL"):
        raise UsageError("sasl.mechanism is set but security.protocol is not SASL_PLAINTEXT/SASL_SSL")
    return result


def _connection_only(confluent_config: Mapping[str, Any]) -> dict[str, Any]:
    """The librdkafka settings a helper consumer needs to reach the cluster."""
    keep = {"bootstrap.servers", "metadata.broker.list", "client.id", "client.dns.lookup"}
    return {k: v for k, v in confluent_config.items() if k in keep or _is_security_key(k)}


# ---------------------------------------------------------------------------
# The control plane
# ---------------------------------------------------------------------------

_COORDINATOR_MOVED = frozenset({"NOT_COORDINATOR", "COORDINATOR_NOT_AVAILABLE"})
_COORDINATOR_BUSY = frozenset({"COORDINATOR_LOAD_IN_PROGRESS", "CONCURRENT_TRANSACTIONS"})
_LEADER_MOVED = frozenset(
    # kafka-python names code 6 NOT_LEADER_FOR_PARTITION (its pre-2.7 wire name).
    {"NOT_LEADER_OR_FOLLOWER", "NOT_LEADER_FOR_PARTITION", "LEADER_NOT_AVAILABLE", "UNKNOWN_TOPIC_OR_PARTITION"}
)
# Highest EndTxn version with transaction-version-1 semantics.  v5 (KIP-890
# part 2) makes the coordinator bump the epoch when the transaction completes,
# which a librdkafka (TV1) transaction must not see: the stored
# {producer_id, epoch} would stop matching and a retry would be fenced.
_END_TXN_MAX_TV1_VERSION = 4
_INIT_PID_2PC_VERSION = 6
_ISOLATION_READ_COMMITTED = 1
_EARLIEST_TIMESTAMP = -2
_LATEST_TIMESTAMP = -1
_PROBE_TRANSACTIONAL_ID = "kafka2pc-capability-probe"

_OPPOSITE_OUTCOME_STATES = {
    True: ("PrepareAbort", "CompleteAbort", "aborted"),
    False: ("PrepareCommit", "CompleteCommit", "committed"),
}


_CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.KafkaConnectionError,
    kafka_errors.NodeNotReadyError,
    kafka_errors.RequestTimedOutError,
    kafka_errors.KafkaTimeoutError,
)


class _Retry(Exception):
    """Internal: the attempt failed with a retriable wire error."""

    def __init__(self, code: int, refresh_coordinator: bool = False) -> None:
        super().__init__(code)
        self.code = code
        self.refresh_coordinator = refresh_coordinator


class _InvalidTxnState(Exception):
    """Internal: EndTxn answered INVALID_TXN_STATE (explained outside the retry loop)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class ControlPlane:
    """A client for the transaction coordinator and partition leaders.

    Construct it with the same confluent-kafka style config as the producer
    (only the connection and security settings are used).  It connects on the
    first call, so constructing one is cheap; close it (or use ``with``) when
    done.  Every call is bounded: each request waits at most
    ``request_timeout_s`` and retriable wire errors are retried at most
    ``max_retries`` times with exponential backoff.

    >>> with ControlPlane({"bootstrap.servers": "localhost:9092"}) as cp:  # doctest: +SKIP
    ...     cp.describe_transaction("orders-tx-1")
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        request_timeout_s: float = 30.0,
        max_retries: int = 20,
    ) -> None:
        if request_timeout_s <= 0:
            raise UsageError("request_timeout_s must be positive")
        if max_retries < 0:
            raise UsageError("max_retries must not be negative")
        self._confluent_config = dict(config)
        self._kafka_python_config = kafka_python_config(config)
        self._request_timeout_ms = int(request_timeout_s * 1000)
        self._max_retries = max_retries
        self._lock = threading.Lock()
        self._admin: KafkaAdminClient | None = None
        self._closed = False
        self._coordinators: dict[str, int] = {}
        self._keep_prepared_supported: bool | None = None
        self._requests: Counter[str] = Counter()
        quiet_kafka_python()  # kafka-python's INFO chatter -> DEBUG (kafka2pc._logging)

    # -- lifecycle -----------------------------------------------------------

    def close(self) -> None:
        """Close the connections (idempotent)."""
        with self._lock:
            self._closed = True
            admin, self._admin = self._admin, None
        if admin is not None:
            admin.close()

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _client(self) -> KafkaAdminClient:
        with self._lock:
            if self._closed:
                raise UsageError("ControlPlane is closed")
            if self._admin is None:
                try:
                    self._admin = KafkaAdminClient(
                        **self._kafka_python_config,
                        request_timeout_ms=self._request_timeout_ms,
                        bootstrap_timeout_ms=self._request_timeout_ms,
                    )
                except kafka_errors.KafkaError as exc:
                    raise translate_kafka_python_error(
                        exc, "connecting the control plane to the cluster"
                    ) from exc
            return self._admin

    def _run(self, context: str, coro: Callable[[], Awaitable[_T]]) -> _T:
        """Run a coroutine on kafka-python's IO thread; translate its errors."""
        admin = self._client()
        try:
            result: _T = admin._manager.run(coro)
        except Kafka2pcError:
            raise
        except kafka_errors.KafkaError as exc:
            raise translate_kafka_python_error(exc, context) from exc
        return result

    # -- low-level helpers (run on the IO thread) ------------------------------

    async def _send(self, request: Any, node_id: int | None) -> Any:
        manager = self._client()._manager
        self._requests[type(request).__name__.removesuffix("Request")] += 1
        return await manager.send(request, node_id=node_id, request_timeout_ms=self._request_timeout_ms)

    @property
    def requests_sent(self) -> dict[str, int]:
        """Requests sent so far by API name (``{"EndTxn": 1, ...}``), a copy.

        Counts what kafka2pc itself asks of the cluster (not kafka-python's
        connection bootstrap or its periodic metadata refresh); a
        ``record_outcome`` read_committed probe counts as ``"OutcomeProbe"`` and
        a topic listing as ``"ListTopics"``.  Lets tests and benchmarks check
        that a producer's steady-state transactions cost no control-plane
        round trip.
        """
        return dict(self._requests)

    async def _sleep_backoff(self, attempt: int) -> None:
        await self._client()._manager._net.sleep(min(0.05 * (2**attempt), 2.0))

    async def _coordinator(self, transactional_id: str, *, refresh: bool = False) -> int:
        """Node id of the transaction coordinator of ``transactional_id`` (cached)."""
        if not refresh and transactional_id in self._coordinators:
            return self._coordinators[transactional_id]
        manager = self._client()._manager
        for attempt in range(self._max_retries + 1):
            request = FindCoordinatorRequest(
                key=transactional_id, key_type=CoordinatorType.TRANSACTION.value, max_version=3
            )
            response = await self._send(request, None)
            name = error_name_for_code(response.error_code) if response.error_code else None
            if name is None:
                manager.cluster.add_coordinator(
                    response, CoordinatorType.TRANSACTION, transactional_id, synthesize_node_id=False
                )
                node_id = int(response.node_id)
                self._coordinators[transactional_id] = node_id
                return node_id
            if name not in _COORDINATOR_MOVED | _COORDINATOR_BUSY or attempt == self._max_retries:
                raise translate_kafka_python_error(
                    response.error_code, f"FindCoordinator for transactional id {transactional_id!r}"
                )
            log.info("FindCoordinator(%r): %s, retrying", transactional_id, name)
            await self._sleep_backoff(attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _with_coordinator(
        self,
        transactional_id: str,
        context: str,
        attempt_fn: Callable[[int], Awaitable[_T]],
    ) -> _T:
        """Call ``attempt_fn(coordinator)`` with bounded retries on coordinator errors."""
        refresh = False
        last_code = 0
        for attempt in range(self._max_retries + 1):
            try:
                coordinator = await self._coordinator(transactional_id, refresh=refresh)
                return await attempt_fn(coordinator)
            except _CONNECTION_ERRORS as exc:
                # Only reads get here: end_txn turns an in-flight failure into
                # IndefiniteOutcomeError itself.  The coordinator may have died:
                # find it again.
                log.info("%s: %s (attempt %d of %d), retrying", context, exc, attempt + 1,
                         self._max_retries + 1)
                last_code, refresh = 15, True  # COORDINATOR_NOT_AVAILABLE
                await self._sleep_backoff(attempt)
            except _Retry as retry:
                last_code, refresh = retry.code, retry.refresh_coordinator
                log.info(
                    "%s: %s (attempt %d of %d), retrying",
                    context,
                    error_name_for_code(retry.code),
                    attempt + 1,
                    self._max_retries + 1,
                )
                await self._sleep_backoff(attempt)
        raise translate_kafka_python_error(
            last_code, f"{context}: gave up after {self._max_retries + 1} attempts"
        )

    @staticmethod
    def _check_coordinator_code(code: int, context: str) -> None:
        """Raise ``_Retry`` for coordinator hiccups, a kafka2pc error for others."""
        if code == 0:
            return
        name = error_name_for_code(code)
        if name in _COORDINATOR_MOVED:
            raise _Retry(code, refresh_coordinator=True)
        if name in _COORDINATOR_BUSY:
            raise _Retry(code)
        raise translate_kafka_python_error(code, context)

    async def _leader(self, tp: TopicPartition) -> int:
        request = MetadataRequest(
            topics=[MetadataRequest.MetadataRequestTopic(name=tp.topic)],
            allow_auto_topic_creation=False,
        )
        response = await self._send(request, None)
        for topic in response.topics:
            if topic.name != tp.topic:
                continue
            if topic.error_code:
                raise _Retry(topic.error_code)
            for partition in topic.partitions:
                if partition.partition_index == tp.partition:
                    if partition.leader_id < 0:
                        raise _Retry(5)  # LEADER_NOT_AVAILABLE
                    return int(partition.leader_id)
            raise translate_kafka_python_error(3, f"partition {tp} does not exist")
        raise _Retry(3)

    async def _with_leader(
        self, tp: TopicPartition, context: str, attempt_fn: Callable[[int], Awaitable[_T]]
    ) -> _T:
        last_code = 0
        for attempt in range(self._max_retries + 1):
            try:
                leader = await self._leader(tp)
                return await attempt_fn(leader)
            except _CONNECTION_ERRORS as exc:  # the leader may have died: ask metadata again
                last_code = 6  # NOT_LEADER_OR_FOLLOWER
                log.info("%s: %s, retrying", context, exc)
                await self._sleep_backoff(attempt)
            except _Retry as retry:
                last_code = retry.code
                log.info("%s: %s, retrying", context, error_name_for_code(retry.code))
                await self._sleep_backoff(attempt)
        raise translate_kafka_python_error(
            last_code, f"{context}: gave up after {self._max_retries + 1} attempts"
        )

    # -- metadata --------------------------------------------------------------

    def api_versions(self) -> dict[str, tuple[int, int]]:
        """API name -> ``(min, max)`` version the bootstrap broker advertises.

        Capabilities are detected from this (and probes), never from version
        strings.  Unknown API keys are named by number.
        """
        admin = self._client()
        data = admin._manager.broker_version_data
        if data is None or data.api_versions is None:
            raise BrokerUnavailableError("no ApiVersions answer from the cluster yet")
        result: dict[str, tuple[int, int]] = {}
        for key, (low, high) in sorted(data.api_versions.items()):
            name = ApiKey(key).name if key in ApiKey._value2member_map_ else str(key)
            result[name] = (int(low), int(high))
        return result

    def broker_config(self, names: Collection[str]) -> dict[str, str]:
        """Values of broker settings (DescribeConfigs on one broker).

        Used to check ``transaction.max.timeout.ms`` and
        ``transaction.two.phase.commit.enable`` before relying on them.  Names
        the broker does not know, and sensitive values (reported as null),
        are absent from the result.
        """
        wanted = list(names)

        async def go() -> dict[str, str]:
            manager = self._client()._manager
            brokers = sorted(b.node_id for b in manager.cluster.brokers())
            if not brokers:
                raise BrokerUnavailableError("cluster metadata lists no broker")
            node_id = brokers[0]
            resource = DescribeConfigsRequest.DescribeConfigsResource(
                resource_type=4, resource_name=str(node_id), configuration_keys=wanted
            )
            response = await self._send(DescribeConfigsRequest(resources=[resource]), node_id)
            values: dict[str, str] = {}
            for result in response.results:
                if result.error_code:
                    raise translate_kafka_python_error(
                        result.error_code, f"DescribeConfigs on broker {node_id}"
                    )
                for entry in result.configs:
                    if entry.value is not None:
                        values[entry.name] = entry.value
            return values

        return self._run("DescribeConfigs", go)

    # -- transactions ----------------------------------------------------------

    def describe_transaction(self, transactional_id: str) -> TransactionDescription | None:
        """What the coordinator knows about ``transactional_id``; ``None`` if nothing.

        ``None`` means TRANSACTIONAL_ID_NOT_FOUND: the id never initialised a
        producer, or it expired (``transactional.id.expiration.ms``).
        """
        context = f"DescribeTransactions for {transactional_id!r}"

        async def attempt(coordinator: int) -> TransactionDescription | None:
            request = DescribeTransactionsRequest(transactional_ids=[transactional_id])
            response = await self._send(request, coordinator)
            for txn in response.transaction_states:
                if txn.transactional_id != transactional_id:
                    continue
                if error_name_for_code(txn.error_code) == "TRANSACTIONAL_ID_NOT_FOUND":
                    return None
                self._check_coordinator_code(txn.error_code, context)
                partitions = tuple(
                    sorted(
                        TopicPartition(topic.topic, int(p))
                        for topic in txn.topics
                        for p in topic.partitions
                    )
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
                kafka_errors.KafkaProtocolError("no entry for the transactional id in the answer"),
                context,
            )

        return self._run(context, lambda: self._with_coordinator(transactional_id, context, attempt))

    def topic_names(self) -> list[str]:
        """Names of every topic in the cluster (used to resolve digest-stored anchor topics)."""
        admin = self._client()
        self._requests["ListTopics"] += 1
        try:
            return sorted(admin.list_topics())
        except kafka_errors.KafkaError as exc:
            raise translate_kafka_python_error(exc, "listing topics") from exc

    def describe_producers(self, tp: TopicPartition) -> list[ProducerState]:
        """Active producers on ``tp``, asked of the partition leader.

        The row of a producer with an open transaction carries the offset of
        that transaction's first record on ``tp`` (``current_txn_start_offset``).
        """
        context = f"DescribeProducers for {tp.topic}-{tp.partition}"

        async def attempt(leader: int) -> list[ProducerState]:
            request = DescribeProducersRequest(
                topics=[
                    DescribeProducersRequest.TopicRequest(
                        name=tp.topic, partition_indexes=[tp.partition]
                    )
                ]
            )
            response = await self._send(request, leader)
            for topic in response.topics:
                for partition in topic.partitions:
                    if topic.name != tp.topic or partition.partition_index != tp.partition:
                        continue
                    if partition.error_code:
                        if error_name_for_code(partition.error_code) in _LEADER_MOVED:
                            raise _Retry(partition.error_code)
                        raise translate_kafka_python_error(partition.error_code, context)
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

        return self._run(context, lambda: self._with_leader(tp, context, attempt))

    def list_transactions(
        self, *, states: Collection[str] = (), min_duration_ms: int | None = None
    ) -> list[TransactionListing]:
        """Transactions known to every broker's coordinator, optionally filtered.

        Each broker coordinates a slice of ``__transaction_state``, so every
        broker is asked.  ``min_duration_ms`` needs ListTransactions v1
        (Kafka 3.8+); an older broker raises :class:`UnsupportedBrokerError`.
        """
        state_filters = list(states)
        context = "ListTransactions"

        async def go() -> list[TransactionListing]:
            manager = self._client()._manager
            listings: list[TransactionListing] = []
            for broker in sorted(manager.cluster.brokers(), key=lambda b: b.node_id):
                kwargs: dict[str, Any] = {"state_filters": state_filters, "producer_id_filters": []}
                if min_duration_ms is not None:
                    kwargs.update(duration_filter=int(min_duration_ms), min_version=1)
                response = await self._send(ListTransactionsRequest(**kwargs), broker.node_id)
                if response.error_code:
                    raise translate_kafka_python_error(
                        response.error_code, f"{context} on broker {broker.node_id}"
                    )
                listings.extend(
                    TransactionListing(
                        transactional_id=str(t.transactional_id),
                        producer_id=int(t.producer_id),
                        state=str(t.transaction_state),
                    )
                    for t in response.transaction_states
                )
            return sorted(listings, key=lambda t: t.transactional_id)

        return self._run(context, go)

    def end_txn(
        self, transactional_id: str, producer_id: int, producer_epoch: int, *, commit: bool
    ) -> None:
        """Commit or abort the transaction open under ``{producer_id, epoch}``.

        This is how a prepared transaction of a crashed producer is completed
        (the approach of Flink's ``resumeTransaction``): EndTxn straight to the
        coordinator with the stored ids.  The caller must first check that the
        open transaction *is* the prepared one (DescribeTransactions +
        DescribeProducers anchor): with librdkafka (transaction version 1)
        consecutive transactions share ``{producer_id, epoch}``, and EndTxn
        completes whichever one is open.

        Version: at most EndTxn v4.  Against 4.3.1, v5 on a TV1 transaction
        commits it but bumps the epoch (TV2 semantics), after which a retry
        with the stored epoch is answered PRODUCER_FENCED; v3/v4 complete it
        and keep the epoch, which is what the stored prepared state names.

        Outcomes (observed on 4.3.1):

        * repeating the *same* decision after it completed is answered with
          success by the coordinator, so a retry is harmless and returns;
        * the opposite decision after completion is INVALID_TXN_STATE (or
          CONCURRENT_TRANSACTIONS while markers are written, retried here);
          if the coordinator then reports the same ids settled the other way
          this raises :class:`HeuristicOutcomeError` (``outcome`` says which);
        * a different epoch: PRODUCER_FENCED -> :class:`ProducerFencedError`
          (also what a transaction aborted by its timeout looks like: the
          coordinator bumped the epoch); a different producer id:
          INVALID_PRODUCER_ID_MAPPING -> :class:`ProducerFencedError`;
        * no answer in time, or the connection dropped with the request in
          flight: :class:`IndefiniteOutcomeError` — it may or may not have
          been applied; ask :meth:`describe_transaction`/:meth:`record_outcome`.

        Retried with backoff (at most ``max_retries``): NOT_COORDINATOR and
        COORDINATOR_NOT_AVAILABLE (after finding the coordinator again),
        COORDINATOR_LOAD_IN_PROGRESS and CONCURRENT_TRANSACTIONS.
        """
        decision = "commit" if commit else "abort"
        context = (
            f"EndTxn({decision}) for {transactional_id!r} "
            f"producer_id={producer_id} epoch={producer_epoch}"
        )

        async def attempt(coordinator: int) -> None:
            request = EndTxnRequest(
                transactional_id=transactional_id,
                producer_id=producer_id,
                producer_epoch=producer_epoch,
                committed=commit,
                max_version=_END_TXN_MAX_TV1_VERSION,
            )
            try:
                response = await self._send(request, coordinator)
            except kafka_errors.NodeNotReadyError:
                raise _Retry(15, refresh_coordinator=True) from None  # never sent
            except kafka_errors.IncompatibleBrokerVersion:
                raise
            except kafka_errors.KafkaError as exc:
                raise IndefiniteOutcomeError(
                    f"{context}: no answer ({exc}); the transaction may or may not be "
                    f"{decision}ed",
                    state=(producer_id, producer_epoch),
                ) from exc
            code = int(response.error_code)
            if code == 0:
                log.info("%s: done (EndTxn v%s)", context, request.API_VERSION)
                return
            if error_name_for_code(code) == "INVALID_TXN_STATE":
                raise _InvalidTxnState(code)
            self._check_coordinator_code(code, context)

        async def go() -> None:
            try:
                await self._with_coordinator(transactional_id, context, attempt)
            except _InvalidTxnState as invalid_state:
                await self._explain_invalid_txn_state(
                    transactional_id, producer_id, producer_epoch, commit, invalid_state.code, context
                )

        self._run(context, go)

    async def _explain_invalid_txn_state(
        self,
        transactional_id: str,
        producer_id: int,
        producer_epoch: int,
        commit: bool,
        code: int,
        context: str,
    ) -> None:
        """INVALID_TXN_STATE from EndTxn: was it settled the other way?"""
        prepare_state, complete_state, outcome = _OPPOSITE_OUTCOME_STATES[commit]
        coordinator = await self._coordinator(transactional_id)
        response = await self._send(
            DescribeTransactionsRequest(transactional_ids=[transactional_id]), coordinator
        )
        for txn in response.transaction_states:
            if (
                txn.error_code == 0
                and txn.producer_id == producer_id
                and txn.producer_epoch == producer_epoch
                and txn.transaction_state in (prepare_state, complete_state)
            ):
                raise HeuristicOutcomeError(
                    f"{context}: the coordinator already {outcome} the transaction "
                    f"(state {txn.transaction_state})",
                    transactional_id=transactional_id,
                    state=(producer_id, producer_epoch),
                    outcome=outcome,
                    error_name="INVALID_TXN_STATE",
                    error_code=code,
                )
        raise translate_kafka_python_error(code, context)

    def init_producer_id(
        self,
        transactional_id: str,
        *,
        transaction_timeout_ms: int,
        keep_prepared_txn: bool = False,
        enable_2pc: bool = False,
    ) -> InitProducerIdResult:
        """InitProducerId for ``transactional_id`` (KIP-939 fields when asked).

        With ``keep_prepared_txn=False`` this is KIP-939's
        ``forceTerminateTransaction``: the coordinator aborts any open
        transaction and bumps the epoch, fencing every older instance.  (It
        first answers CONCURRENT_TRANSACTIONS while the abort markers are
        written; that is retried here.)

        ``keep_prepared_txn``/``enable_2pc`` need InitProducerId v6.  If the
        coordinator's broker does not advertise v6, nothing is sent and
        :class:`UnsupportedBrokerError` is raised.  If it does but the
        coordinator refuses (UNSUPPORTED_VERSION), the same error is raised.
        Observed on 4.3.1: v6 is not advertised (it is an unstable version;
        sending it anyway makes the broker close the connection, the request
        never reaches the coordinator).  With ``unstable.api.versions.enable``
        the coordinator answers ``KeepPreparedTxn=true`` with
        UNSUPPORTED_VERSION and the open transaction stays exactly as it was
        (state Ongoing, same producer id and epoch, same partitions, same
        CurrentTxnStartOffset).  ``Enable2Pc=true`` alone is accepted and, like
        any InitProducerId without ``KeepPreparedTxn``, aborts the open
        transaction.
        """
        wants_2pc = keep_prepared_txn or enable_2pc
        context = (
            f"InitProducerId for {transactional_id!r}"
            f" (keepPreparedTxn={keep_prepared_txn}, enable2Pc={enable_2pc})"
        )

        async def attempt(coordinator: int) -> InitProducerIdResult:
            kwargs: dict[str, Any] = {
                "transactional_id": transactional_id,
                "transaction_timeout_ms": int(transaction_timeout_ms),
            }
            if wants_2pc:
                kwargs.update(
                    keep_prepared_txn=keep_prepared_txn,
                    enable2_pc=enable_2pc,
                    min_version=_INIT_PID_2PC_VERSION,
                )
            else:
                kwargs["max_version"] = _INIT_PID_2PC_VERSION - 1
            request = InitProducerIdRequest(**kwargs)
            try:
                response = await self._send(request, coordinator)
            except kafka_errors.IncompatibleBrokerVersion as exc:
                raise UnsupportedBrokerError(
                    f"{context}: the transaction coordinator (broker {coordinator}) does not "
                    "support InitProducerId v6 (KIP-939), so it cannot keep a prepared "
                    "transaction or enable 2PC; nothing was sent",
                    error_name="UNSUPPORTED_VERSION",
                    error_code=35,
                ) from exc
            code = int(response.error_code)
            if wants_2pc and error_name_for_code(code) == "UNSUPPORTED_VERSION":
                raise UnsupportedBrokerError(
                    f"{context}: the transaction coordinator refused the KIP-939 request "
                    "(UNSUPPORTED_VERSION); the open transaction was left as it was",
                    error_name="UNSUPPORTED_VERSION",
                    error_code=code,
                )
            self._check_coordinator_code(code, context)
            return InitProducerIdResult(
                producer_id=int(response.producer_id),
                producer_epoch=int(response.producer_epoch),
                ongoing_txn_producer_id=int(getattr(response, "ongoing_txn_producer_id", -1)),
                ongoing_txn_epoch=int(getattr(response, "ongoing_txn_producer_epoch", -1)),
            )

        result = self._run(
            context, lambda: self._with_coordinator(transactional_id, context, attempt)
        )
        log.info("%s: producer_id=%d epoch=%d", context, result.producer_id, result.producer_epoch)
        return result

    def supports_keep_prepared_txn(self) -> bool:
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
        low_high = self.api_versions().get(ApiKey.InitProducerId.name)
        supported = False
        if low_high is not None and low_high[1] >= _INIT_PID_2PC_VERSION:
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

    # -- hanging transactions (operator tools: `kafka2pc abort`) -------------------

    def abort_partition_transaction(
        self, tp: TopicPartition, producer_id: int, producer_epoch: int, *, coordinator_epoch: int = -1
    ) -> None:
        """Write an abort marker for ``producer_id``'s open transaction on ``tp`` (WriteTxnMarkers).

        Kafka's admin ``abortTransaction`` (``kafka-transactions.sh abort``),
        for a *hanging* transaction: one a partition still holds open although
        its coordinator does not (KAFKA-12671), which pins the partition's
        last stable offset forever.  Sent to the partition leader, which checks
        the producer id and epoch; ``coordinator_epoch=-1`` skips the
        coordinator-epoch check, as the Java admin client does.  The
        coordinator is not told: aborting a transaction it still tracks
        leaves it to abort again when its timeout expires.
        """
        context = f"WriteTxnMarkers (abort) for producer {producer_id}/{producer_epoch} on {tp.topic}-{tp.partition}"

        async def attempt(leader: int) -> None:
            marker = WriteTxnMarkersRequest.WritableTxnMarker(
                producer_id=producer_id,
                producer_epoch=producer_epoch,
                transaction_result=False,
                topics=[
                    WriteTxnMarkersRequest.WritableTxnMarker.WritableTxnMarkerTopic(
                        name=tp.topic, partition_indexes=[tp.partition]
                    )
                ],
                coordinator_epoch=coordinator_epoch,
            )
            response = await self._send(WriteTxnMarkersRequest(markers=[marker]), leader)
            for result in response.markers:
                for topic in result.topics:
                    for partition in topic.partitions:
                        if partition.error_code:
                            if error_name_for_code(partition.error_code) in _LEADER_MOVED:
                                raise _Retry(partition.error_code)
                            raise translate_kafka_python_error(partition.error_code, context)

        self._run(context, lambda: self._with_leader(tp, context, attempt))
        log.warning("%s: done", context)

    # -- outcome of one record ---------------------------------------------------

    def record_outcome(self, tp: TopicPartition, offset: int) -> str:
        """Was the record at ``tp``/``offset`` committed, aborted, or is it undecided?

        Returns ``"committed"``, ``"aborted"``, ``"ongoing"`` (the last stable
        offset is not past it yet: its transaction is still open) or
        ``"unknown"`` (below the log start offset: deleted by retention).

        Two steps.  The log start offset and the last stable offset (LSO) come
        from ListOffsets with READ_COMMITTED isolation, sent by kafka-python
        to the leader: exact protocol semantics, no consumer needed for the
        common "ongoing"/"unknown" answers.  Below the LSO every transaction
        is decided, and the question is whether a read_committed reader sees
        the record.  That is answered with a short-lived librdkafka consumer
        (``isolation.level=read_committed``, assigned at ``offset``, no group
        membership, no commits): filtering aborted records needs the fetch
        response's aborted-transaction index applied to the record batches,
        and librdkafka's implementation of that is the one the application's
        own readers use, so the answer matches what they see.  The first
        record it returns decides: offset ``offset`` -> committed; a later
        offset, or reaching the LSO (partition EOF) first -> aborted.  Records
        removed by compaction would read as aborted; use this on topics with
        ``cleanup.policy=delete``.  The whole call is bounded by
        ``request_timeout_s``; if the consumer gets no answer in that time,
        :class:`BrokerUnavailableError` is raised.
        """
        if offset < 0:
            raise UsageError(f"offset must be >= 0, got {offset}")
        context = f"record outcome of {tp.topic}-{tp.partition}@{offset}"
        log_start, lso = self._offsets(tp, context)
        if offset < log_start:
            log.info("%s: below log start offset %d -> unknown", context, log_start)
            return "unknown"
        if lso <= offset:
            log.info("%s: last stable offset %d not past it -> ongoing", context, lso)
            return "ongoing"
        outcome = self._read_committed_probe(tp, offset, context)
        log.info("%s: %s (log start %d, LSO %d)", context, outcome, log_start, lso)
        return outcome

    def _offsets(self, tp: TopicPartition, context: str) -> tuple[int, int]:
        """``(log_start_offset, last_stable_offset)`` of ``tp``."""

        log_start, lso, _ = self._offset_triple(tp, context, high_watermark=False)
        return log_start, lso

    def partition_offsets(self, tp: TopicPartition) -> tuple[int, int, int]:
        """``(log_start_offset, last_stable_offset, high_watermark)`` of ``tp``.

        ``high_watermark - last_stable_offset`` is how many records an open
        transaction holds back from ``read_committed`` consumers.
        """
        return self._offset_triple(tp, f"offsets of {tp.topic}-{tp.partition}", high_watermark=True)

    def _offset_triple(
        self, tp: TopicPartition, context: str, *, high_watermark: bool
    ) -> tuple[int, int, int]:
        async def list_offset(leader: int, timestamp: int, isolation: int = _ISOLATION_READ_COMMITTED) -> int:
            request = ListOffsetsRequest(
                replica_id=-1,
                isolation_level=isolation,
                topics=[
                    ListOffsetsRequest.ListOffsetsTopic(
                        name=tp.topic,
                        partitions=[
                            ListOffsetsRequest.ListOffsetsTopic.ListOffsetsPartition(
                                partition_index=tp.partition, timestamp=timestamp
                            )
                        ],
                    )
                ],
                min_version=2,
            )
            response = await self._send(request, leader)
            for topic in response.topics:
                for partition in topic.partitions:
                    if partition.error_code:
                        if error_name_for_code(partition.error_code) in _LEADER_MOVED | {
                            "OFFSET_NOT_AVAILABLE"
                        }:
                            raise _Retry(partition.error_code)
                        raise translate_kafka_python_error(partition.error_code, context)
                    return int(partition.offset)
            raise translate_kafka_python_error(
                kafka_errors.KafkaProtocolError("no entry for the partition in the answer"), context
            )

        async def attempt(leader: int) -> tuple[int, int, int]:
            return (
                await list_offset(leader, _EARLIEST_TIMESTAMP),
                await list_offset(leader, _LATEST_TIMESTAMP),
                await list_offset(leader, _LATEST_TIMESTAMP, 0) if high_watermark else -1,
            )

        return self._run(context, lambda: self._with_leader(tp, context, attempt))

    def _read_committed_probe(self, tp: TopicPartition, offset: int, context: str) -> str:
        from confluent_kafka import Consumer, KafkaError, KafkaException
        from confluent_kafka import TopicPartition as ConfluentTopicPartition

        deadline = time.monotonic() + self._request_timeout_ms / 1000
        self._requests["OutcomeProbe"] += 1
        config = _connection_only(self._confluent_config)
        config.update(
            {
                "group.id": f"kafka2pc-outcome-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "isolation.level": "read_committed",
                "enable.partition.eof": True,
                "auto.offset.reset": "error",
                "fetch.max.bytes": 1_048_576,
            }
        )
        with_librdkafka_logger(config)  # librdkafka's logs -> logging (kafka2pc._logging)
        try:
            consumer = Consumer(config)
        except KafkaException as exc:
            raise UsageError(f"{context}: cannot create the outcome consumer: {exc}") from exc
        try:
            consumer.assign([ConfluentTopicPartition(tp.topic, tp.partition, offset)])
            while (remaining := deadline - time.monotonic()) > 0:
                message = consumer.poll(min(remaining, 0.5))
                if message is None:
                    continue
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        return "aborted"
                    if error.code() == KafkaError._AUTO_OFFSET_RESET:
                        return "unknown"  # deleted between ListOffsets and the fetch
                    if error.fatal() or not error.retriable():
                        raise BrokerUnavailableError(f"{context}: {error.str()}")
                    continue
                found = message.offset()
                if found is None or found < offset:
                    continue
                return "committed" if found == offset else "aborted"
        finally:
            consumer.close()
        raise BrokerUnavailableError(
            f"{context}: no answer from a read_committed fetch within "
            f"{self._request_timeout_ms} ms"
        )
