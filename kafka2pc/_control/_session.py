"""The control plane's connection: one kafka-python client, deadlines, routing and retries.

:class:`Session` is what every control-plane call stands on: it maps the
user's confluent-kafka config once (:mod:`._config`), connects lazily within
the caller's deadline, runs coroutines on kafka-python's IO thread
(:mod:`._kafka_python`), and sends a request to the transaction coordinator
or a partition leader with :mod:`._retry`'s routine.  The calls themselves
(what to send, what the answer means) are :class:`kafka2pc._control.ControlPlane`'s
and :class:`kafka2pc._control._completion.Completion`'s, which hold a session
and use only the methods without a leading underscore here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, TypeVar

import kafka.errors as kafka_errors
from kafka.admin import KafkaAdminClient

from kafka2pc._control import _kafka_python as compat
from kafka2pc._control import _protocol as protocol
from kafka2pc._control._config import connection_settings
from kafka2pc._control._retry import (
    Deadline,
    Retry,
    Route,
    call_with_retries,
    check_code,
)
from kafka2pc._errors import WireError, translate_kafka_python_error
from kafka2pc._exceptions import Kafka2pcError, UsageError
from kafka2pc._fork import ForkGuard, abandon
from kafka2pc._logging import quiet_kafka_python
from kafka2pc._types import TopicPartition

__all__ = ["DEFAULT_CONTROL_TIMEOUT_S", "DEFAULT_REQUEST_TIMEOUT_S", "Session", "on_topic", "on_txn_id"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_CONTROL_TIMEOUT_S = 30.0
"""Default bound of one control-plane call (connecting, retries and backoff included)."""
DEFAULT_REQUEST_TIMEOUT_S = 30.0
"""Default bound of one request on the wire (a call may send several)."""

ANY_BROKER_ATTEMPT_MIN_S = 2.0
"""Shortest wait for one broker's answer to a request any broker can answer, before trying the next."""

CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.KafkaConnectionError,
    kafka_errors.NodeNotReadyError,
    kafka_errors.RequestTimedOutError,
    kafka_errors.KafkaTimeoutError,
)


def on_txn_id(operation: str, transactional_id: str) -> str:
    """The ACL ``operation`` on one transactional id, as an authorization error names it."""
    return f"{operation} on TransactionalId {transactional_id!r}"


def on_topic(operation: str, topic: str) -> str:
    """The ACL ``operation`` on one topic, as an authorization error names it."""
    return f"{operation} on Topic {topic!r}"


class Session:
    """One lazily connected kafka-python client with per-call deadlines and routed retries."""

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        max_retries: int = 20,
        timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
    ) -> None:
        if request_timeout_s <= 0:
            raise UsageError("request_timeout_s must be positive")
        if timeout_s <= 0:
            raise UsageError("timeout_s must be positive")
        if max_retries < 0:
            raise UsageError("max_retries must not be negative")
        settings = connection_settings(config)
        self._fork_guard = ForkGuard("ControlPlane")
        self._librdkafka = dict(settings.librdkafka)
        self._kafka_python = dict(settings.kafka_python)
        self._request_timeout_ms = int(request_timeout_s * 1000)
        self._timeout_s = float(timeout_s)
        self._max_retries = max_retries
        self._lock = threading.Lock()
        self._local = threading.local()
        self._admin: KafkaAdminClient | None = None
        self._closed = False
        self._coordinators: dict[str, int] = {}
        self._leaders: dict[TopicPartition, int] = {}
        self._any_node: int | None = None
        self._requests: Counter[str] = Counter()
        quiet_kafka_python()  # kafka-python's INFO chatter -> DEBUG (kafka2pc._logging)

    @property
    def librdkafka(self) -> dict[str, Any]:
        """The connection and security settings mapped for librdkafka (a copy), e.g. for the outcome probe."""
        return dict(self._librdkafka)

    def connected_client(self) -> KafkaAdminClient | None:
        """The kafka-python client, ``None`` before the first call connected it (tests and benchmarks)."""
        with self._lock:
            return self._admin

    def count(self, label: str) -> None:
        """Count one request that :meth:`send` does not send (e.g. the ``read_committed`` outcome probe)."""
        self._requests[label] += 1

    @property
    def timeout_s(self) -> float:
        """The bound of a call given no ``timeout`` (outside any :meth:`deadline` block)."""
        return self._timeout_s

    def close(self) -> None:
        """Close the connections (idempotent).

        In a child forked after the session was made, nothing is closed: the
        inherited client (whose IO thread lives in the parent) is abandoned
        to the parent (:func:`kafka2pc._fork.abandon`) and the call returns at once.
        """
        with self._lock:
            self._closed = True
            admin, self._admin = self._admin, None
        if admin is not None:
            if self._fork_guard.forked:
                abandon(admin)
            else:
                admin.close()

    @contextlib.contextmanager
    def deadline(self, timeout_s: float | None) -> Iterator[Deadline]:
        """Bound every call made by this thread inside the block to end within ``timeout_s`` from now.

        ``None`` means the plane's ``timeout_s``.  A block inside another, or a
        call's own ``timeout``, can only make the bound earlier.  This is how
        a caller that makes several calls (recovery: describe, then
        DescribeProducers, then EndTxn...) holds all of them to one timeout.
        """
        deadline = self._deadline(timeout_s)
        stack: list[Deadline] = self._local.__dict__.setdefault("stack", [])
        stack.append(deadline)
        try:
            yield deadline
        finally:
            stack.pop()

    def _deadline(self, timeout: float | None) -> Deadline:
        if timeout is not None and timeout <= 0:
            raise UsageError(f"timeout must be positive, got {timeout}")
        own = Deadline.after(self._timeout_s if timeout is None else float(timeout))
        stack: list[Deadline] = self._local.__dict__.get("stack", [])
        return own.earlier(stack[-1] if stack else None)

    def call_deadline(self, timeout: float | None) -> Deadline:
        """The deadline of one call: its ``timeout``, else the enclosing block's, else ``timeout_s``."""
        stack: list[Deadline] = self._local.__dict__.get("stack", [])
        if timeout is None and stack:
            return stack[-1]
        return self._deadline(timeout)

    def client(self, deadline: Deadline, context: str) -> KafkaAdminClient:
        """The kafka-python client, connected first (within ``deadline``) if it is not yet."""
        self._fork_guard.check()  # kafka-python's IO thread lives in the parent: a call would never return
        with self._lock:
            if self._closed:
                raise UsageError("ControlPlane is closed")
            if self._admin is None:
                if deadline.expired():
                    raise deadline.exceeded(context, "not connected yet")
                try:
                    self._admin = compat.new_admin_client(
                        self._kafka_python,
                        request_timeout_ms=self._request_timeout_ms,
                        bootstrap_timeout_ms=deadline.remaining_ms(self._request_timeout_ms),
                    )
                except kafka_errors.KafkaError as exc:
                    raise translate_kafka_python_error(
                        exc, f"{context}: connecting the control plane to {self._kafka_python['bootstrap_servers']}"
                    ) from exc
            return self._admin

    def run(self, context: str, deadline: Deadline, coro: Callable[[KafkaAdminClient], Awaitable[_T]]) -> _T:
        """Run ``coro(admin)`` on kafka-python's IO thread; translate its errors."""
        admin = self.client(deadline, context)
        try:
            return compat.run_on_io_thread(admin, lambda: coro(admin))
        except Kafka2pcError:
            raise
        except kafka_errors.KafkaError as exc:
            if deadline.expired() and isinstance(exc, CONNECTION_ERRORS):
                raise deadline.exceeded(context, str(exc)) from exc
            raise translate_kafka_python_error(exc, context) from exc

    # -- low-level helpers (run on the IO thread) ------------------------------

    async def send(self, admin: KafkaAdminClient, request: Any, node_id: int | None, deadline: Deadline,
                   context: str, *, label: str | None = None, cap_ms: int | None = None) -> Any:
        """Send ``request`` to ``node_id`` (``None``: any) within ``deadline``; count it under ``label``."""
        timeout_ms = deadline.remaining_ms(self._request_timeout_ms if cap_ms is None
                                           else min(cap_ms, self._request_timeout_ms))
        if timeout_ms <= 0:
            raise deadline.exceeded(context)
        self._requests[label or type(request).__name__.removesuffix("Request")] += 1
        return await compat.send(admin, request, node_id, timeout_ms)

    @property
    def requests_sent(self) -> dict[str, int]:
        """Requests sent so far by API name (``{"EndTxn": 1, ...}``), a copy.

        Counts what kafka2pc itself asks of the cluster (not kafka-python's
        connection bootstrap or its periodic metadata refresh); a
        ``record_outcome`` read_committed probe counts as ``"OutcomeProbe"`` and
        a topic listing as ``"ListTopics"``.  Lets tests and benchmarks check that a producer's steady-state
        transactions cost no control-plane round trip.
        """
        return dict(self._requests)

    def wire_requests_written(self) -> int:
        """Every request written on the control plane's connections so far, kafka-python's own included.

        Unlike :attr:`requests_sent` this counts the client's bootstrap and
        its periodic metadata refresh too (``0`` before the first call).
        Benchmarks use it to show the steady state costs no round trip at all.
        """
        with self._lock:
            admin = self._admin
        return 0 if admin is None else compat.requests_written(admin)

    def _with_route(
        self,
        admin: KafkaAdminClient,
        route: Route,
        context: str,
        deadline: Deadline,
        resolve: Callable[[bool], Awaitable[int]],
        attempt_fn: Callable[[int], Awaitable[_T]],
    ) -> Awaitable[_T]:
        return call_with_retries(
            route, context, resolve, attempt_fn,
            max_retries=self._max_retries,
            deadline=deadline,
            sleep=lambda seconds: compat.sleep(admin, seconds),
            connection_errors=CONNECTION_ERRORS,
        )

    def on_coordinator(
        self,
        transactional_id: str,
        context: str,
        deadline: Deadline,
        attempt_fn: Callable[[KafkaAdminClient, int], Awaitable[_T]],
    ) -> _T:
        """``attempt_fn(admin, coordinator)`` with the coordinator route's retries."""

        async def go(admin: KafkaAdminClient) -> _T:
            async def resolve(refresh: bool) -> int:
                return await self.coordinator(admin, transactional_id, refresh, deadline)

            return await self._with_route(
                admin, Route.COORDINATOR, context, deadline, resolve, lambda node: attempt_fn(admin, node)
            )

        return self.run(context, deadline, go)

    def on_leader(
        self,
        tp: TopicPartition,
        context: str,
        deadline: Deadline,
        attempt_fn: Callable[[KafkaAdminClient, int], Awaitable[_T]],
    ) -> _T:
        """``attempt_fn(admin, leader)`` with the partition-leader route's retries."""

        async def go(admin: KafkaAdminClient) -> _T:
            async def resolve(refresh: bool) -> int:
                return await self._leader(admin, tp, refresh, deadline)

            return await self._with_route(
                admin, Route.LEADER, context, deadline, resolve, lambda node: attempt_fn(admin, node)
            )

        return self.run(context, deadline, go)

    def on_any_broker(
        self,
        context: str,
        deadline: Deadline,
        attempt_fn: Callable[[KafkaAdminClient, int, int], Awaitable[_T]],
    ) -> _T:
        """``attempt_fn(admin, node, cap_ms)`` on a broker any of which can answer, moving on when one fails.

        A broker that refuses the connection or does not answer within
        ``cap_ms`` (a third of the time left, at least
        :data:`ANY_BROKER_ATTEMPT_MIN_S`) is left for the next one in the
        cluster's metadata, with the retry route's backoff and the call's deadline.
        """

        async def go(admin: KafkaAdminClient) -> _T:
            async def resolve(refresh: bool) -> int:
                return self._any_broker(admin, refresh, context)

            async def attempt(node: int) -> _T:
                cap_ms = int(max(ANY_BROKER_ATTEMPT_MIN_S, deadline.remaining() / 3) * 1000)
                return await attempt_fn(admin, node, cap_ms)

            return await self._with_route(admin, Route.ANY_BROKER, context, deadline, resolve, attempt)

        return self.run(context, deadline, go)

    def _any_broker(self, admin: KafkaAdminClient, refresh: bool, context: str) -> int:
        """A broker of the cluster's metadata: the one that answered last, or (``refresh``) another one."""
        brokers = compat.broker_ids(admin)
        if not brokers:
            raise translate_kafka_python_error(
                kafka_errors.NodeNotReadyError("cluster metadata lists no broker"), context
            )
        current = self._any_node
        if current in brokers and not refresh:
            return current
        # kafka-python's pick (connected first, none in reconnect backoff), else the next in turn.
        chosen = compat.least_loaded_broker(admin)
        if chosen is None or chosen not in brokers or chosen == current:
            chosen = brokers[0] if current not in brokers else next((b for b in brokers if b > current), brokers[0])
        self._any_node = chosen
        return chosen

    async def coordinator(
        self, admin: KafkaAdminClient, transactional_id: str, refresh: bool, deadline: Deadline
    ) -> int:
        """Node id of the transaction coordinator of ``transactional_id`` (cached until it moves)."""
        if not refresh and transactional_id in self._coordinators:
            return self._coordinators[transactional_id]
        context = f"FindCoordinator for transactional id {transactional_id!r}"
        request = protocol.find_transaction_coordinator(transactional_id)
        response = await self.send(admin, request, None, deadline, context)
        check_code(Route.COORDINATOR, int(response.error_code), context,
                   needs=on_txn_id("DESCRIBE", transactional_id))
        compat.remember_transaction_coordinator(admin, response, transactional_id)
        node_id = int(response.node_id)
        self._coordinators[transactional_id] = node_id
        return node_id

    async def _leader(self, admin: KafkaAdminClient, tp: TopicPartition, refresh: bool, deadline: Deadline) -> int:
        """Node id of the leader of ``tp`` (cached until it moves: a refresh asks Metadata again)."""
        if not refresh and tp in self._leaders:
            return self._leaders[tp]
        self._leaders.pop(tp, None)
        context = f"Metadata for {tp.topic}-{tp.partition}"
        response = await self.send(admin, protocol.metadata(tp.topic), None, deadline, context)
        for topic in response.topics:
            if topic.name != tp.topic:
                continue
            check_code(Route.LEADER, int(topic.error_code), context, needs=on_topic("DESCRIBE", tp.topic))
            for partition in topic.partitions:
                if partition.partition_index == tp.partition:
                    if partition.leader_id < 0:
                        raise Retry(WireError.LEADER_NOT_AVAILABLE, re_resolve=True)
                    self._leaders[tp] = int(partition.leader_id)
                    return int(partition.leader_id)
            raise translate_kafka_python_error(
                WireError.UNKNOWN_TOPIC_OR_PARTITION, f"partition {tp} does not exist"
            )
        raise Retry(WireError.UNKNOWN_TOPIC_OR_PARTITION, re_resolve=True)
