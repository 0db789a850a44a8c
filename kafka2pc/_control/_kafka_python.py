"""Every use of kafka-python beyond its documented API, in one place.

The control plane needs more of kafka-python than ``KafkaAdminClient``'s
public methods give: sending an arbitrary request to a chosen node (the
transaction coordinator, a partition leader) on the client's IO thread,
sleeping on that thread, reading the ApiVersions the bootstrap broker
advertised, and registering a coordinator found by our own FindCoordinator.
Those live on ``KafkaAdminClient._manager`` (a ``KafkaConnectionManager``)
and its selector (``_manager._net``), which kafka-python documents nowhere
and may change in any release.  Nothing outside this module touches them.

:func:`check_compatibility` lists, in words, every assumption this module
(and the control plane's use of the protocol classes) makes about the
installed kafka-python; ``tests/unit/test_kafka_python_compat.py`` fails with
that list when a release breaks one of them, and the dependency pin in
``pyproject.toml`` covers exactly the releases that test passed on.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import kafka
import kafka.errors as kafka_errors
from kafka.admin import KafkaAdminClient
from kafka.protocol.api_key import ApiKey
from kafka.protocol.metadata import CoordinatorType

__all__ = [
    "KAFKA_PYTHON_VERSION",
    "advertised_api_versions",
    "api_key_name",
    "broker_ids",
    "check_compatibility",
    "new_admin_client",
    "remember_transaction_coordinator",
    "requests_written",
    "run_on_io_thread",
    "send",
    "sleep",
]

_T = TypeVar("_T")

KAFKA_PYTHON_VERSION: str = str(getattr(kafka, "__version__", "unknown"))


def new_admin_client(
    settings: Mapping[str, Any], *, request_timeout_ms: int, bootstrap_timeout_ms: int
) -> KafkaAdminClient:
    """A started, bootstrapped ``KafkaAdminClient`` (blocks at most ``bootstrap_timeout_ms``).

    kafka-python starts the client's IO thread before it bootstraps and does
    not stop it when bootstrapping fails; every failed attempt would leave a
    thread and its sockets behind.  So the object is made first and closed
    here if its bootstrap raises.
    """
    admin = KafkaAdminClient.__new__(KafkaAdminClient)
    try:
        admin.__init__(
            **settings,
            request_timeout_ms=request_timeout_ms,
            bootstrap_timeout_ms=max(1, bootstrap_timeout_ms),
        )
    except BaseException:
        _close_half_made(admin)
        raise
    return admin


def _close_half_made(admin: KafkaAdminClient) -> None:
    """Stop the IO thread and close the connections of a client whose ``__init__`` raised."""
    try:
        if hasattr(admin, "_net"):
            admin._closed = False  # close() is a no-op until __init__ has finished
            admin.close()
    except Exception:  # noqa: BLE001 - best effort: the original error matters
        pass


def run_on_io_thread(admin: KafkaAdminClient, coro_fn: Callable[[], Awaitable[_T]]) -> _T:
    """Run ``coro_fn()`` on the client's IO thread; block the caller until it finishes."""
    result: _T = admin._manager.run(coro_fn)
    return result


async def send(admin: KafkaAdminClient, request: Any, node_id: int | None, timeout_ms: int) -> Any:
    """Send ``request`` to ``node_id`` (``None``: the least loaded broker); its response.

    Bounded twice: kafka-python's request timeout, and a wait on the response
    future that also covers a connection still being set up.
    """
    manager = admin._manager
    future = manager.send(request, node_id=node_id, request_timeout_ms=max(1, timeout_ms))
    return await manager.wait_for(future, max(1, timeout_ms))


async def sleep(admin: KafkaAdminClient, seconds: float) -> None:
    """Sleep on the IO thread without blocking its other work."""
    await admin._manager._net.sleep(max(0.0, seconds))


def remember_transaction_coordinator(admin: KafkaAdminClient, response: Any, transactional_id: str) -> None:
    """Tell the client's cluster metadata about a coordinator FindCoordinator returned.

    kafka-python connects to a node only if its metadata knows the node's
    address; a FindCoordinator answer carries it.
    """
    admin._manager.cluster.add_coordinator(
        response, CoordinatorType.TRANSACTION, transactional_id, synthesize_node_id=False
    )


def broker_ids(admin: KafkaAdminClient) -> list[int]:
    """Node ids of the brokers in the client's cluster metadata, sorted."""
    return sorted(int(b.node_id) for b in admin._manager.cluster.brokers())


def least_loaded_broker(admin: KafkaAdminClient) -> int | None:
    """kafka-python's pick of a broker: connected and idle first, never one in reconnect backoff."""
    node = admin._manager.least_loaded_node()
    return None if node is None else int(node)


def advertised_api_versions(admin: KafkaAdminClient) -> dict[int, tuple[int, int]] | None:
    """API key -> ``(min, max)`` version the bootstrap broker advertised; ``None`` before bootstrap."""
    data = admin._manager.broker_version_data
    if data is None or data.api_versions is None:
        return None
    return {int(key): (int(low), int(high)) for key, (low, high) in data.api_versions.items()}


def requests_written(admin: KafkaAdminClient) -> int:
    """Requests written so far on the client's open connections (their last correlation ids)."""
    return sum(int(conn.parser._correlation_id) for conn in list(admin._manager._conns.values()))


def api_key_name(key: int) -> str:
    """The protocol name of an API key (``22`` -> ``"InitProducerId"``); unknown keys by number."""
    try:
        return str(ApiKey(key).name)
    except ValueError:
        return str(key)


# ---------------------------------------------------------------------------
# Compatibility check
# ---------------------------------------------------------------------------

# (class path, attribute, what kafka2pc uses it for)
_MEMBERS = (
    ("kafka.admin.KafkaAdminClient", "DEFAULT_CONFIG", "the keyword settings KafkaAdminClient accepts"),
    ("kafka.net.manager.KafkaConnectionManager", "run", "run a coroutine on the IO thread"),
    ("kafka.net.manager.KafkaConnectionManager", "send", "send a request to a chosen node"),
    ("kafka.net.manager.KafkaConnectionManager", "wait_for", "bound the wait for a response"),
)
_ADMIN_SETTINGS = (
    "bootstrap_servers", "client_id", "request_timeout_ms", "bootstrap_timeout_ms", "security_protocol",
    "sasl_mechanism", "sasl_plain_username", "sasl_plain_password", "sasl_kerberos_service_name",
    "ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_password", "ssl_crlfile", "ssl_check_hostname",
)
_ERROR_CLASSES = (
    "KafkaError", "BrokerResponseError", "KafkaConnectionError", "NodeNotReadyError", "RequestTimedOutError",
    "KafkaTimeoutError", "IncompatibleBrokerVersion", "UnrecognizedBrokerVersion", "AuthorizationError",
    "UnknownBrokerIdError", "KafkaProtocolError",
)


def _resolve(path: str) -> Any:
    module_name, _, name = path.rpartition(".")
    module = __import__(module_name, fromlist=[name])
    return getattr(module, name)


def check_compatibility(admin: KafkaAdminClient | None = None) -> list[str]:
    """Every broken assumption about the installed kafka-python, as sentences (empty: all hold).

    Without ``admin`` only what can be checked without a broker is checked
    (classes, methods, settings, protocol schemas); with a bootstrapped
    client, also the private instance members used above.
    """
    from kafka2pc._control import _protocol

    problems: list[str] = []
    where = f"kafka-python {KAFKA_PYTHON_VERSION}"
    for path, attribute, purpose in _MEMBERS:
        try:
            owner = _resolve(path)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{where}: {path} is gone ({exc}); kafka2pc uses it to {purpose}")
            continue
        if not hasattr(owner, attribute):
            problems.append(f"{where}: {path}.{attribute} is gone; kafka2pc uses it to {purpose}")
    send_parameters: Mapping[str, Any]
    try:
        manager_class = _resolve("kafka.net.manager.KafkaConnectionManager")
        send_parameters = inspect.signature(manager_class.send).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        send_parameters = {}
    for parameter in ("node_id", "request_timeout_ms"):
        if parameter not in send_parameters:
            problems.append(f"{where}: KafkaConnectionManager.send no longer takes {parameter}=")
    accepted = set(getattr(KafkaAdminClient, "DEFAULT_CONFIG", {}))
    for setting in _ADMIN_SETTINGS:
        if setting not in accepted:
            problems.append(f"{where}: KafkaAdminClient no longer accepts {setting}=")
    for name in _ERROR_CLASSES:
        if not isinstance(getattr(kafka_errors, name, None), type):
            problems.append(f"{where}: kafka.errors.{name} is gone")
    for key, name in ((22, "InitProducerId"), (26, "EndTxn"), (65, "DescribeTransactions")):
        if api_key_name(key) != name:
            problems.append(f"{where}: ApiKey({key}) is no longer named {name}")
    if not hasattr(CoordinatorType, "TRANSACTION"):
        problems.append(f"{where}: CoordinatorType.TRANSACTION is gone")
    problems.extend(f"{where}: {problem}" for problem in _protocol.check_schemas())
    if admin is not None:
        problems.extend(f"{where}: {problem}" for problem in _check_instance(admin))
    return problems


def _check_instance(admin: KafkaAdminClient) -> list[str]:
    problems: list[str] = []
    manager = getattr(admin, "_manager", None)
    if manager is None:
        return ["KafkaAdminClient._manager is gone (the connection manager kafka2pc sends through)"]
    net = getattr(manager, "_net", None)
    if net is None or not callable(getattr(net, "sleep", None)):
        problems.append("KafkaAdminClient._manager._net.sleep is gone (sleeping on the IO thread)")
    cluster = getattr(manager, "cluster", None)
    for attribute in ("add_coordinator", "brokers"):
        if not callable(getattr(cluster, attribute, None)):
            problems.append(f"KafkaAdminClient._manager.cluster.{attribute} is gone")
    if cluster is not None and callable(getattr(cluster, "add_coordinator", None)):
        parameters = inspect.signature(cluster.add_coordinator).parameters
        if "synthesize_node_id" not in parameters:
            problems.append("ClusterMetadata.add_coordinator no longer takes synthesize_node_id=")
    data = getattr(manager, "broker_version_data", None)
    versions = getattr(data, "api_versions", None)
    if not isinstance(versions, dict) or not all(
        isinstance(v, tuple) and len(v) == 2 for v in versions.values()
    ):
        problems.append(
            "KafkaAdminClient._manager.broker_version_data.api_versions is no longer a "
            "{api_key: (min, max)} dict after bootstrap"
        )
    return problems
