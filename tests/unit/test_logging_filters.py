"""The log filters of ``kafka2pc._logging``: one line per condition, kafka-python's chatter at DEBUG."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kafka2pc._logging import (
    ConditionFilter,
    DemoteInfoFilter,
    LibrdkafkaFilter,
    librdkafka_logger,
    quiet_kafka_python,
    with_librdkafka_logger,
)

FAIL = (
    "[thrd:127.0.0.1:9092/bootstrap]: 127.0.0.1:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 failed: "
    "Connection refused (after 0ms in state CONNECT)"
)


def _record(name: str, level: int, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_condition_filter_passes_the_first_line_then_one_per_window_with_the_count() -> None:
    clock = _Clock()
    flt = ConditionFilter(60, clock=clock)
    first = _record("x", logging.WARNING, "broker 127.0.0.1:%d down after %dms", 9092, 12)
    assert flt.filter(first)
    for i in range(5):
        clock.now += 1
        assert not flt.filter(_record("x", logging.WARNING, "broker 127.0.0.1:%d down after %dms", 9092, i))
    assert flt.filter(_record("x", logging.WARNING, "another condition"))
    clock.now += 60
    again = _record("x", logging.WARNING, "broker 127.0.0.1:%d down after %dms", 9092, 99)
    assert flt.filter(again)
    assert again.getMessage().endswith("(and 5 more like it in the last 65s)")
    clock.now += 1
    assert not flt.filter(_record("x", logging.WARNING, "broker 127.0.0.1:%d down after %dms", 9092, 7))


def test_condition_filter_keeps_levels_and_loggers_apart() -> None:
    flt = ConditionFilter(60, clock=_Clock())
    assert flt.filter(_record("a", logging.WARNING, "same"))
    assert flt.filter(_record("b", logging.WARNING, "same"))
    assert flt.filter(_record("a", logging.ERROR, "same"))
    assert not flt.filter(_record("a", logging.WARNING, "same"))


def test_librdkafka_filter_rewrites_and_relevels_an_unreachable_broker() -> None:
    flt = LibrdkafkaFilter(60, clock=_Clock())
    record = _record("kafka2pc.librdkafka", logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", FAIL)
    assert flt.filter(record)
    assert record.levelno == logging.WARNING and record.levelname == "WARNING"
    assert record.getMessage() == (
        "Kafka unreachable (librdkafka reconnects by itself; not logged again for 60s): "
        "rdkafka#producer-1 FAIL: 127.0.0.1:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 failed: Connection refused"
    )
    # The same condition on the broker's other handle, with librdkafka's own counters: dropped.
    other_handle = FAIL.replace("/bootstrap", "/1").replace("CONNECT)", "CONNECT, 4 identical error(s) suppressed)")
    assert not flt.filter(
        _record("kafka2pc.librdkafka", logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", other_handle)
    )


def test_librdkafka_filter_puts_self_healing_retries_at_info() -> None:
    logger = logging.getLogger("kafka2pc.librdkafka")
    flt = LibrdkafkaFilter(60, clock=_Clock())
    text = "[thrd:main]: Failed to acquire transactional PID from broker TxnCoordinator/1: " \
        "Broker: Coordinator load in progress: retrying"
    record = _record(logger.name, logging.WARNING, "%s [%s] %s", "GETPID", "rdkafka#producer-1", text)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        assert flt.filter(record)
        assert record.levelno == logging.INFO
        logger.setLevel(logging.WARNING)  # not enabled for INFO: the demoted record is dropped
        again = _record(logger.name, logging.WARNING, "%s [%s] %s", "GETPID", "rdkafka#producer-2", text + " ")
        assert not flt.filter(again)
    finally:
        logger.setLevel(old)


def test_librdkafka_filter_keeps_a_real_error_an_error() -> None:
    flt = LibrdkafkaFilter(60, clock=_Clock())
    record = _record("kafka2pc.librdkafka", logging.ERROR, "%s [%s] %s", "TXNERR", "rdkafka#producer-1",
                     "[thrd:main]: Fatal transaction error: Producer fenced by newer instance")
    assert flt.filter(record)
    assert record.levelno == logging.ERROR


@pytest.fixture
def kafka_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("kafka.k2pc_test_module")
    saved = (logger.level, list(logger.filters))
    yield logger
    logger.setLevel(saved[0])
    logger.filters[:] = saved[1]


def test_demote_info_filter_turns_info_into_debug(kafka_logger: logging.Logger) -> None:
    flt = DemoteInfoFilter()
    kafka_logger.setLevel(logging.INFO)
    info = _record(kafka_logger.name, logging.INFO, "Bootstrap complete")
    assert not flt.filter(info)  # INFO enabled, DEBUG not: the chatter is gone
    kafka_logger.setLevel(logging.DEBUG)
    info = _record(kafka_logger.name, logging.INFO, "Bootstrap complete")
    assert flt.filter(info) and info.levelname == "DEBUG"  # who asks for DEBUG still gets it
    warning = _record(kafka_logger.name, logging.WARNING, "Node 1 not ready")
    assert flt.filter(warning) and warning.levelno == logging.WARNING


def test_quiet_kafka_python_installs_filters_unless_the_user_configured_kafka(
    kafka_logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    parent = logging.getLogger("kafka")
    assert parent.level == logging.NOTSET  # nobody configured it in this test session
    assert quiet_kafka_python()
    assert any(isinstance(f, DemoteInfoFilter) for f in kafka_logger.filters)
    caplog.set_level(logging.INFO)  # the application asks for INFO on the root logger
    kafka_logger.info("IO loop starting")
    kafka_logger.warning("Connection to node 1 failed")
    assert [r.getMessage() for r in caplog.records] == ["Connection to node 1 failed"]

    parent.setLevel(logging.INFO)
    try:
        assert not quiet_kafka_python()  # configured by the application: left alone
    finally:
        parent.setLevel(logging.NOTSET)


def test_with_librdkafka_logger_keeps_a_logger_the_user_chose() -> None:
    mine = logging.getLogger("my.app.kafka")
    assert with_librdkafka_logger({"logger": mine})["logger"] is mine
    assert with_librdkafka_logger({})["logger"] is librdkafka_logger()
    assert any(isinstance(f, LibrdkafkaFilter) for f in librdkafka_logger().filters)


def test_an_unreachable_broker_is_one_warning_per_library_without_traceback() -> None:
    flt = ConditionFilter(60, clock=_Clock())
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError:
        import sys

        record = logging.LogRecord("kafka.net.transport", logging.ERROR, __file__, 1,
                                   "Error receiving network data closing socket", (), sys.exc_info())
    assert flt.filter(record)
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert record.getMessage() == (
        "Kafka unreachable (kafka-python reconnects by itself; not logged again for 60s): Error receiving network "
        "data closing socket (ConnectionResetError: [Errno 104] Connection reset by peer)"
    )
    for name, text in (
        ("kafka.net.manager", "Connection failed: KafkaConnectionError: 111 ECONNREFUSED"),
        ("kafka.cluster", "Metadata refresh: failed KafkaConnectionError: 111 ECONNREFUSED"),
        ("kafka.cluster", "No node available for metadata refresh - backoff/retry"),
    ):
        assert not flt.filter(_record(name, logging.ERROR, text))  # the same condition, same library
    assert flt.filter(_record("kafka2pc.librdkafka", logging.WARNING, "Connect to ipv4#1.2.3.4:9 failed"))


def test_the_dual_writes_topic_check_logs_on_the_producers_librdkafka_logger() -> None:
    """The recipe names the logger without importing the private module; the two names must agree."""
    from kafka2pc.recipes.dual_write._topics import LIBRDKAFKA_LOGGER

    from kafka2pc._logging import LIBRDKAFKA_LOGGER_NAME

    assert LIBRDKAFKA_LOGGER == LIBRDKAFKA_LOGGER_NAME
