"""The one place where kafka-python errors become kafka2pc errors.

The control plane talks to the cluster through kafka-python; whatever it
raises (an exception instance or class) or returns (a numeric error code in a
response) goes through :func:`translate_kafka_python_error`, so that callers
only ever see the tree drawn in :mod:`kafka2pc._exceptions`.  The caller
chains the original: ``raise translate_kafka_python_error(exc, ctx) from exc``.

The table follows the semantics the Java ``TransactionManager`` gives each
error on the transactional APIs:

=============================================  ==========================
wire error                                     kafka2pc class
=============================================  ==========================
TRANSACTIONAL_ID_AUTHORIZATION_FAILED,         AuthorizationError
CLUSTER_/TOPIC_/GROUP_AUTHORIZATION_FAILED,
SASL_AUTHENTICATION_FAILED
PRODUCER_FENCED, INVALID_PRODUCER_EPOCH,       ProducerFencedError
INVALID_PRODUCER_ID_MAPPING,
TRANSACTION_COORDINATOR_FENCED
UNSUPPORTED_VERSION (and kafka-python's        UnsupportedBrokerError
IncompatibleBrokerVersion), UNSUPPORTED_...
INVALID_TXN_STATE, TRANSACTION_ABORTABLE       AbortableError
REQUEST_TIMED_OUT, client-side timeouts,       BrokerUnavailableError
connection failures, no broker reachable
NOT_COORDINATOR, COORDINATOR_LOAD_IN_PROGRESS, RetriableError
COORDINATOR_NOT_AVAILABLE,
CONCURRENT_TRANSACTIONS, any other retriable
any other broker error                         FatalError
anything else                                  KafkaTransactionError
=============================================  ==========================

A timed-out *EndTxn* is not retriable but indefinite; that decision needs the
context of the call and is taken by the control plane, not here.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from kafka2pc._exceptions import (
    AbortableError,
    AuthorizationError,
    BrokerUnavailableError,
    FatalError,
    Kafka2pcError,
    KafkaTransactionError,
    ProducerFencedError,
    RetriableError,
    UnsupportedBrokerError,
)
from kafka2pc._kafka_python_import import kafka_errors  # imports kafka-python without its DeprecationWarning

if TYPE_CHECKING:
    from confluent_kafka import KafkaError as ConfluentKafkaError
    from confluent_kafka import KafkaException as ConfluentKafkaException

__all__ = [
    "WireError",
    "error_name_for_code",
    "kafka_exception_in",
    "translate_confluent_error",
    "translate_kafka_python_error",
]


class WireError(enum.IntEnum):
    """The Kafka protocol error codes the control plane acts on, by their wire names.

    Logic compares codes with these names, never with bare numbers; the
    numbers are Apache Kafka's (``org.apache.kafka.common.protocol.Errors``)
    and are pinned against kafka-python's table by a test.
    """

    NONE = 0
    UNKNOWN_TOPIC_OR_PARTITION = 3
    LEADER_NOT_AVAILABLE = 5
    NOT_LEADER_OR_FOLLOWER = 6
    REQUEST_TIMED_OUT = 7
    BROKER_NOT_AVAILABLE = 8
    NETWORK_EXCEPTION = 13
    COORDINATOR_LOAD_IN_PROGRESS = 14
    COORDINATOR_NOT_AVAILABLE = 15
    NOT_COORDINATOR = 16
    TOPIC_AUTHORIZATION_FAILED = 29
    CLUSTER_AUTHORIZATION_FAILED = 31
    UNSUPPORTED_VERSION = 35
    INVALID_TXN_STATE = 48
    TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
    CONCURRENT_TRANSACTIONS = 51
    OFFSET_NOT_AVAILABLE = 78
    TRANSACTIONAL_ID_NOT_FOUND = 105

_AUTHORIZATION = frozenset(
    {
        "TRANSACTIONAL_ID_AUTHORIZATION_FAILED",
        "CLUSTER_AUTHORIZATION_FAILED",
        "TOPIC_AUTHORIZATION_FAILED",
        "GROUP_AUTHORIZATION_FAILED",
        "SASL_AUTHENTICATION_FAILED",
        "DELEGATION_TOKEN_AUTHORIZATION_FAILED",
    }
)
_FENCED = frozenset(
    {
        "PRODUCER_FENCED",
        "INVALID_PRODUCER_EPOCH",
        "INVALID_PRODUCER_ID_MAPPING",
        "TRANSACTION_COORDINATOR_FENCED",
    }
)
_UNSUPPORTED = frozenset({"UNSUPPORTED_VERSION", "UNSUPPORTED_FOR_MESSAGE_FORMAT"})
_ABORTABLE = frozenset({"INVALID_TXN_STATE", "TRANSACTION_ABORTABLE"})
_UNAVAILABLE = frozenset({"REQUEST_TIMED_OUT", "NETWORK_EXCEPTION", "BROKER_NOT_AVAILABLE"})
_RETRIABLE = frozenset(
    {
        "NOT_COORDINATOR",
        "COORDINATOR_LOAD_IN_PROGRESS",
        "COORDINATOR_NOT_AVAILABLE",
        "CONCURRENT_TRANSACTIONS",
        "NOT_LEADER_OR_FOLLOWER",
        "NOT_LEADER_FOR_PARTITION",  # kafka-python's (pre-2.7) name for code 6
        "LEADER_NOT_AVAILABLE",
    }
)
# The ACL a wire error says is missing, when the request does not say more precisely.
_ACL_HINTS = {
    "TRANSACTIONAL_ID_AUTHORIZATION_FAILED": "WRITE (and DESCRIBE) on TransactionalId",
    "CLUSTER_AUTHORIZATION_FAILED": "an operation on the Cluster (DESCRIBE_CONFIGS, IDEMPOTENT_WRITE)",
    "TOPIC_AUTHORIZATION_FAILED": "WRITE (to produce) or READ/DESCRIBE (to read) on Topic",
    "GROUP_AUTHORIZATION_FAILED": "READ on Group",
}
# Client-side conditions (no wire code) meaning "nobody answered in time".
_CLIENT_UNAVAILABLE: tuple[type[Exception], ...] = (
    kafka_errors.KafkaTimeoutError,
    kafka_errors.KafkaConnectionError,
    kafka_errors.NodeNotReadyError,
    kafka_errors.UnknownBrokerIdError,
    TimeoutError,
    ConnectionError,
)


def error_name_for_code(code: int) -> str:
    """The broker's wire name for an error code (``"UNKNOWN_SERVER_ERROR"`` style)."""
    error_class = kafka_errors.for_code(code)
    name = getattr(error_class, "message", None)
    return name if isinstance(name, str) and name else f"UNKNOWN_ERROR_CODE_{code}"


def translate_kafka_python_error(
    exc_or_code: BaseException | type[BaseException] | int, context: str, *, needs: str | None = None
) -> Kafka2pcError:
    """Return the kafka2pc exception for a kafka-python error or a wire error code.

    ``context`` says what was being done (``"EndTxn(commit) for 'tx-1'"``) and
    starts the message, so that a log line alone tells what failed.
    ``needs`` names the ACL the request needs (``"WRITE on TransactionalId
    'tx-1'"``); an authorization failure's message then says it is missing.
    The result is returned, not raised, so the caller can chain it with
    ``raise ... from exc``.
    """
    if isinstance(exc_or_code, Kafka2pcError):
        return exc_or_code
    if isinstance(exc_or_code, bool):  # bool is an int; never an error code
        raise TypeError("error code must be an int, not bool")
    if isinstance(exc_or_code, int):
        error_class: type[BaseException] = kafka_errors.for_code(exc_or_code)
        exc: BaseException | None = None
    elif isinstance(exc_or_code, type):
        error_class, exc = exc_or_code, None
    else:
        error_class, exc = type(exc_or_code), exc_or_code

    code: int | None
    name: str | None
    if isinstance(exc_or_code, int):
        code, name = exc_or_code, error_name_for_code(exc_or_code)
    elif issubclass(error_class, kafka_errors.BrokerResponseError):
        raw_code = getattr(error_class, "errno", None)
        code = raw_code if isinstance(raw_code, int) else None
        raw_name = getattr(error_class, "message", None)
        name = raw_name if isinstance(raw_name, str) else None
    else:
        code, name = None, None

    detail = str(exc) if exc is not None and str(exc) else (name or error_class.__name__)
    target = _target_class(error_class, name)
    if target is AuthorizationError and name != "SASL_AUTHENTICATION_FAILED":
        missing = needs or _ACL_HINTS.get(name or "")
        if missing:
            detail += f" (the principal lacks the ACL: {missing})"
    return target(f"{context}: {detail}", error_name=name, error_code=code)


def _target_class(
    error_class: type[BaseException], name: str | None
) -> type[KafkaTransactionError]:
    """The kafka2pc class for a kafka-python error class / wire name."""
    if issubclass(error_class, kafka_errors.IncompatibleBrokerVersion) or issubclass(
        error_class, kafka_errors.UnrecognizedBrokerVersion
    ):
        return UnsupportedBrokerError
    if name in _AUTHORIZATION or issubclass(error_class, kafka_errors.AuthorizationError):
        return AuthorizationError
    if name in _FENCED:
        return ProducerFencedError
    if name in _UNSUPPORTED:
        return UnsupportedBrokerError
    if name in _ABORTABLE:
        return AbortableError
    if name in _UNAVAILABLE or issubclass(error_class, _CLIENT_UNAVAILABLE):
        return BrokerUnavailableError
    if name in _RETRIABLE or getattr(error_class, "retriable", False):
        return RetriableError
    if issubclass(error_class, kafka_errors.BrokerResponseError):
        return FatalError
    return KafkaTransactionError


# -- confluent-kafka (librdkafka) ------------------------------------------------

_CONFLUENT_UNAVAILABLE = frozenset(
    {"_TRANSPORT", "_ALL_BROKERS_DOWN", "_TIMED_OUT", "_MSG_TIMED_OUT", "_RESOLVE", "REQUEST_TIMED_OUT"}
)


def translate_confluent_error(exc: BaseException | ConfluentKafkaError, context: str) -> Kafka2pcError:
    """Translate a confluent-kafka ``KafkaException`` (or ``KafkaError``) into a kafka2pc error.

    librdkafka classifies its errors itself (``fatal()``, ``txn_requires_abort()``,
    ``retriable()``); that classification wins, refined by the wire name for
    fencing and authorization.  Returned, not raised: ``raise ... from exc``.
    """
    from confluent_kafka import KafkaError

    args = getattr(exc, "args", ())  # a bare KafkaError is not an exception: no args
    err = args[0] if args and isinstance(args[0], KafkaError) else exc
    if not isinstance(err, KafkaError):
        return KafkaTransactionError(f"{context}: {exc}")
    name = err.name()
    detail = f"{context}: {err.str()} ({name})"
    if name in _ACL_HINTS:
        detail += f" (the principal lacks the ACL: {_ACL_HINTS[name]})"
    target: type[KafkaTransactionError]
    if name in _AUTHORIZATION:
        target = AuthorizationError
    elif name in _FENCED or name == "_FENCED":
        target = ProducerFencedError
    elif name in _UNSUPPORTED or name == "_UNSUPPORTED_FEATURE":
        target = UnsupportedBrokerError
    elif err.fatal():
        target = FatalError
    elif err.txn_requires_abort():
        target = AbortableError
    elif name in _CONFLUENT_UNAVAILABLE:
        target = BrokerUnavailableError
    elif err.retriable():
        target = RetriableError
    else:
        target = KafkaTransactionError
    return target(detail, error_name=name, error_code=err.code())


def kafka_exception_in(exc: BaseException) -> ConfluentKafkaException | None:
    """The first confluent-kafka ``KafkaException`` in ``exc``'s chain of causes and contexts."""
    from confluent_kafka import KafkaException

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, KafkaException):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def kafka_error_of(exc: BaseException) -> ConfluentKafkaError | None:
    """The ``KafkaError`` a confluent-kafka ``KafkaException`` carries (``None`` for anything else)."""
    from confluent_kafka import KafkaError

    args = getattr(exc, "args", ())
    return args[0] if args and isinstance(args[0], KafkaError) else None
