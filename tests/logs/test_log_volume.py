"""How many log lines a producer application shows: at a normal start, and through a 1-minute broker outage.

The application configures logging as most do (``logging.basicConfig()``:
WARNING and up to stderr).  Measured against a private one-node cluster that
the test stops for 60 s while the application keeps running transactions.
Before kafka2pc routed and de-duplicated the client libraries' logs, the same
run printed 2 lines at start (a WARNING about Enable2Pc and a raw librdkafka
``%4|...|GETPID|`` line) and 137 to 402 lines in the outage (raw
``%3|...|FAIL|`` lines and kafka-python's per-retry ERRORs).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _outage import run_outage
from harness.ports import private_broker

from kafka2pc.testing.broker import LocalKafka


@pytest.fixture(scope="module")
def outage_kafka() -> Iterator[LocalKafka]:
    with private_broker("logs/outage") as kafka:
        yield kafka


def test_a_normal_start_logs_nothing_and_an_outage_one_line_per_condition(outage_kafka: LocalKafka) -> None:
    run = run_outage(outage_kafka, outage_s=60)
    start, outage = run.phases["start"], run.phases["outage"]
    print(f"start: {start.total} stderr lines; outage: {outage.total} stderr lines: {outage.lines}")

    assert start.lines == []  # no Enable2Pc warning, no librdkafka line, no kafka-python chatter
    assert outage.raw_librdkafka == 0, outage.lines  # librdkafka goes through logging
    assert outage.other == 0, outage.lines
    # "Kafka unreachable", at most once per client library (librdkafka, kafka-python), at WARNING.
    assert 1 <= outage.log_lines <= 2, outage.lines
    assert all(line.startswith("LOG WARNING ") for line in outage.lines), outage.lines
    librdkafka = [line for line in outage.lines if line.startswith("LOG WARNING kafka2pc.librdkafka ")]
    kafka_python = [line for line in outage.lines if line.startswith("LOG WARNING kafka.")]
    assert len(librdkafka) <= 1 and len(kafka_python) <= 1, outage.lines
    # kafka-python's connection chatter is DEBUG: no INFO record from it reached the application.
    assert not [k for k in run.records if k.startswith("INFO kafka") and not k.startswith("INFO kafka2pc")]
    assert run.committed_after > run.committed_before  # and the application went on after the outage
