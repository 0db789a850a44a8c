"""The crash tests' independent judge (``harness.kafka_judge``: Kafka's TransactionsCommand) sees what is open.

A judge that parses nothing would let every test pass: here it must name a transaction that plain
confluent-kafka left open, and find nothing once it is aborted.
"""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Producer
from harness.kafka_judge import assert_nothing_open, judge

from kafka2pc.testing import create_topic


def test_the_judge_names_an_open_transaction_and_passes_once_it_is_aborted(kafka_bootstrap: str) -> None:
    topic = create_topic(kafka_bootstrap)
    tid = f"judge-{uuid.uuid4().hex[:8]}"
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": tid})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"open")
    producer.flush(30)  # on the broker: the transaction is Ongoing at its coordinator
    verdict = judge(kafka_bootstrap, [tid, f"{tid}-never-used"], topics=[topic])
    assert verdict.still_open == {tid: "Ongoing"}, verdict
    with pytest.raises(AssertionError, match="lists open transactions"):
        assert_nothing_open(kafka_bootstrap, prefix=tid)
    producer.abort_transaction(30)  # its markers may still be on their way: the judge waits for them
    verdict = assert_nothing_open(kafka_bootstrap, [tid], topics=[topic])
    assert verdict.states == {tid: "CompleteAbort"}
