"""The one place where errors of the libraries underneath become kafka2pc errors (no broker).

Uses real ``confluent_kafka.KafkaError`` / ``KafkaException`` objects and real
kafka-python error classes: the translation tables in :mod:`kafka2pc._errors`
are checked row by row, and every wire error kafka-python knows must land
somewhere in the kafka2pc tree.
"""

from __future__ import annotations

import kafka.errors as kp
import pytest
from confluent_kafka import KafkaError, KafkaException

from kafka2pc import (
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
from kafka2pc._errors import error_name_for_code, translate_confluent_error, translate_kafka_python_error

# -- confluent-kafka -------------------------------------------------------------

# (code, KafkaError flags, expected class)
CONFLUENT_CASES: list[tuple[int, dict[str, bool], type[Kafka2pcError]]] = [
    (KafkaError._FENCED, {"fatal": True}, ProducerFencedError),
    (KafkaError.PRODUCER_FENCED, {"fatal": True}, ProducerFencedError),
    (KafkaError.INVALID_PRODUCER_EPOCH, {}, ProducerFencedError),
    (KafkaError.INVALID_PRODUCER_ID_MAPPING, {"txn_requires_abort": True}, ProducerFencedError),
    (KafkaError.TRANSACTION_COORDINATOR_FENCED, {"fatal": True}, ProducerFencedError),
    (KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, {"fatal": True}, AuthorizationError),
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, {"txn_requires_abort": True}, AuthorizationError),
    (KafkaError.CLUSTER_AUTHORIZATION_FAILED, {"fatal": True}, AuthorizationError),
    (KafkaError.GROUP_AUTHORIZATION_FAILED, {}, AuthorizationError),
    (KafkaError.SASL_AUTHENTICATION_FAILED, {}, AuthorizationError),
    (KafkaError.UNSUPPORTED_VERSION, {"fatal": True}, UnsupportedBrokerError),
    (KafkaError._UNSUPPORTED_FEATURE, {}, UnsupportedBrokerError),
    (KafkaError.UNSUPPORTED_FOR_MESSAGE_FORMAT, {}, UnsupportedBrokerError),
    (KafkaError._INCONSISTENT, {"fatal": True}, FatalError),
    (KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, {"fatal": True}, FatalError),
    (KafkaError._STATE, {"fatal": True, "txn_requires_abort": True}, FatalError),  # fatal wins
    (KafkaError._MSG_TIMED_OUT, {"txn_requires_abort": True}, AbortableError),
    (KafkaError.INVALID_TXN_STATE, {"txn_requires_abort": True}, AbortableError),
    (KafkaError._TIMED_OUT, {"retriable": True}, BrokerUnavailableError),
    (KafkaError._TRANSPORT, {"retriable": True}, BrokerUnavailableError),
    (KafkaError._ALL_BROKERS_DOWN, {}, BrokerUnavailableError),
    (KafkaError.REQUEST_TIMED_OUT, {"retriable": True}, BrokerUnavailableError),
    (KafkaError.CONCURRENT_TRANSACTIONS, {"retriable": True}, RetriableError),
    (KafkaError.COORDINATOR_LOAD_IN_PROGRESS, {"retriable": True}, RetriableError),
    (KafkaError._CONFLICT, {}, KafkaTransactionError),
    (KafkaError.INVALID_CONFIG, {}, KafkaTransactionError),
]


@pytest.mark.parametrize(
    ("code", "flags", "expected"),
    CONFLUENT_CASES,
    ids=[f"{KafkaError(c).name()}-{'+'.join(f) or 'plain'}" for c, f, _ in CONFLUENT_CASES],
)
@pytest.mark.parametrize("wrapped", [True, False], ids=["KafkaException", "KafkaError"])
def test_confluent_error(code: int, flags: dict[str, bool], expected: type[Kafka2pcError], wrapped: bool) -> None:
    err = KafkaError(code, "reason text", **flags)
    exc: BaseException | KafkaError = KafkaException(err) if wrapped else err
    translated = translate_confluent_error(exc, "commit_transaction('tx-1')")
    assert type(translated) is expected
    assert isinstance(translated, KafkaTransactionError)
    assert translated.error_name == err.name()
    assert translated.error_code == code
    message = str(translated)
    assert message.startswith("commit_transaction('tx-1'): ")
    assert "reason text" in message and err.name() in message


def test_confluent_non_kafka_error_becomes_the_base_runtime_error() -> None:
    translated = translate_confluent_error(KafkaException("no KafkaError inside"), "produce('tx')")
    assert type(translated) is KafkaTransactionError
    assert translated.error_name is None and "no KafkaError inside" in str(translated)
    assert type(translate_confluent_error(RuntimeError("x"), "ctx")) is KafkaTransactionError


def test_confluent_error_can_be_chained() -> None:
    err = KafkaException(KafkaError(KafkaError._FENCED, "fenced", fatal=True))
    with pytest.raises(ProducerFencedError) as raised:
        try:
            raise err
        except KafkaException as exc:
            raise translate_confluent_error(exc, "commit") from exc
    assert raised.value.__cause__ is err


# -- kafka-python -----------------------------------------------------------------

KAFKA_PYTHON_BY_NAME: list[tuple[str, type[Kafka2pcError]]] = [
    ("TRANSACTIONAL_ID_AUTHORIZATION_FAILED", AuthorizationError),
    ("CLUSTER_AUTHORIZATION_FAILED", AuthorizationError),
    ("TOPIC_AUTHORIZATION_FAILED", AuthorizationError),
    ("GROUP_AUTHORIZATION_FAILED", AuthorizationError),
    ("SASL_AUTHENTICATION_FAILED", AuthorizationError),
    ("PRODUCER_FENCED", ProducerFencedError),
    ("INVALID_PRODUCER_EPOCH", ProducerFencedError),
    ("INVALID_PRODUCER_ID_MAPPING", ProducerFencedError),
    ("TRANSACTION_COORDINATOR_FENCED", ProducerFencedError),
    ("UNSUPPORTED_VERSION", UnsupportedBrokerError),
    ("UNSUPPORTED_FOR_MESSAGE_FORMAT", UnsupportedBrokerError),
    ("INVALID_TXN_STATE", AbortableError),
    ("TRANSACTION_ABORTABLE", AbortableError),
    ("REQUEST_TIMED_OUT", BrokerUnavailableError),
    ("NETWORK_EXCEPTION", BrokerUnavailableError),
    ("BROKER_NOT_AVAILABLE", BrokerUnavailableError),
    ("NOT_COORDINATOR", RetriableError),
    ("COORDINATOR_LOAD_IN_PROGRESS", RetriableError),
    ("COORDINATOR_NOT_AVAILABLE", RetriableError),
    ("CONCURRENT_TRANSACTIONS", RetriableError),
    ("NOT_LEADER_FOR_PARTITION", RetriableError),  # kafka-python's name for NOT_LEADER_OR_FOLLOWER
    ("LEADER_NOT_AVAILABLE", RetriableError),
    ("UNKNOWN_TOPIC_OR_PARTITION", RetriableError),  # kafka-python marks it retriable
    ("INVALID_CONFIG", FatalError),
    ("TRANSACTIONAL_ID_NOT_FOUND", FatalError),
    ("UNKNOWN", FatalError),  # kafka-python's name for UNKNOWN_SERVER_ERROR (-1)
]

_CODE_BY_NAME = {cls.message: code for code, cls in kp.kafka_errors.items() if isinstance(code, int)}


@pytest.mark.parametrize(("name", "expected"), KAFKA_PYTHON_BY_NAME, ids=[n for n, _ in KAFKA_PYTHON_BY_NAME])
def test_kafka_python_error_by_code_class_and_instance(name: str, expected: type[Kafka2pcError]) -> None:
    code = _CODE_BY_NAME[name]
    error_class = kp.for_code(code)
    assert error_name_for_code(code) == name
    for given in (code, error_class, error_class("detail text")):
        translated = translate_kafka_python_error(given, f"EndTxn(commit) for 'tx-1' [{type(given).__name__}]")
        assert type(translated) is expected, given
        assert isinstance(translated, KafkaTransactionError)
        assert translated.error_name == name
        assert translated.error_code == code
        assert str(translated).startswith("EndTxn(commit) for 'tx-1'")
    assert "detail text" in str(translate_kafka_python_error(error_class("detail text"), "ctx"))


@pytest.mark.parametrize("code", sorted(c for c in kp.kafka_errors if isinstance(c, int) and c != 0))
def test_every_wire_error_lands_in_the_tree(code: int) -> None:
    translated = translate_kafka_python_error(code, "ctx")
    assert isinstance(translated, KafkaTransactionError)
    assert translated.error_code == code
    assert translated.error_name == error_name_for_code(code)
    retriable_in_kafka_python = getattr(kp.for_code(code), "retriable", False)
    if isinstance(translated, RetriableError):
        # Only errors the Java client would also retry are reported as retriable.
        assert retriable_in_kafka_python or translated.error_name == "BROKER_NOT_AVAILABLE"


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (kp.KafkaTimeoutError("no answer in 30000 ms"), BrokerUnavailableError),
        (kp.KafkaConnectionError("refused"), BrokerUnavailableError),
        (kp.NodeNotReadyError("node 1"), BrokerUnavailableError),
        (TimeoutError("socket"), BrokerUnavailableError),
        (ConnectionResetError("reset"), BrokerUnavailableError),
        (kp.IncompatibleBrokerVersion("InitProducerId v6"), UnsupportedBrokerError),
        (kp.UnrecognizedBrokerVersion("?"), UnsupportedBrokerError),
        (kp.KafkaProtocolError("garbled"), KafkaTransactionError),
        (ValueError("not kafka at all"), KafkaTransactionError),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, BaseException) else x.__name__,
)
def test_kafka_python_client_side_errors(error: BaseException, expected: type[Kafka2pcError]) -> None:
    translated = translate_kafka_python_error(error, "DescribeTransactions for 'tx-1'")
    assert type(translated) is expected
    assert str(error) in str(translated)


def test_kafka2pc_errors_pass_through_unchanged() -> None:
    original = ProducerFencedError("already translated")
    assert translate_kafka_python_error(original, "ctx") is original


def test_bool_is_not_an_error_code() -> None:
    with pytest.raises(TypeError):
        translate_kafka_python_error(True, "ctx")


def test_unknown_code_keeps_its_number() -> None:
    translated = translate_kafka_python_error(31337, "ctx")
    assert isinstance(translated, FatalError)
    assert translated.error_code == 31337
