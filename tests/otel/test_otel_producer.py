"""OpenTelemetry for the core producer, against the real broker."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from _otelkit import Collected
from opentelemetry.trace import StatusCode

from kafka2pc import PreparedTxnState, RetriableError, TwoPhaseCommitProducer, TxnState
from kafka2pc.testing import drain

COMMITTED = "kafka2pc.transactions.committed"
ABORTED = "kafka2pc.transactions.aborted"


def test_producer_transactions_become_counters_histograms_gauges_and_spans(
    otel: Collected, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory()
    tid = f"k2pc-otel-{uuid.uuid4().hex[:8]}"
    producer = otel.telemetry.instrument_producer(
        TwoPhaseCommitProducer({"bootstrap.servers": kafka_bootstrap, "transactional.id": tid})
    )
    with producer:
        producer.init_transactions(30)
        for i in range(3):
            producer.begin_transaction()
            producer.produce(topic, value=b"%d" % i)
            producer.prepare_transaction(30)
            producer.commit_transaction(30)
        producer.begin_transaction()
        producer.produce(topic, value=b"aborted")
        assert otel.value("kafka2pc.transaction.open.age", kafka2pc__transactional_id=tid) is not None
        assert otel.value("kafka2pc.transaction.prepared.age", kafka2pc__transactional_id=tid) is None
        producer.abort_transaction(30)

        producer.begin_transaction()
        producer.produce(topic, value=b"prepared")
        state = producer.prepare_transaction(30)
        assert producer.state is TxnState.PREPARED
        prepared_age = otel.value("kafka2pc.transaction.prepared.age", kafka2pc__transactional_id=tid)
        assert prepared_age is not None and prepared_age >= 0
        producer.complete_transaction(PreparedTxnState())  # not the prepared one: abort
        assert producer.state is TxnState.READY

        producer.begin_transaction()
        producer.produce(topic, value=b"completed")
        state = producer.prepare_transaction(30)
        producer.complete_transaction(state)  # its own state: commit

        assert otel.value(COMMITTED, kafka2pc__transactional_id=tid, kafka2pc__component="producer") == 4
        assert otel.value(ABORTED, kafka2pc__transactional_id=tid) == 2
        assert otel.histogram("kafka2pc.transaction.prepare.duration", kafka2pc__transactional_id=tid)[0] == 5
        count, total = otel.histogram("kafka2pc.transaction.commit.duration", kafka2pc__transactional_id=tid)
        assert count == 4 and total > 0
        assert otel.value("kafka2pc.transactions.in_doubt", kafka2pc__transactional_id=tid) == 0
        assert otel.value("kafka2pc.transaction.open.age", kafka2pc__transactional_id=tid) is None
        assert otel.value("kafka2pc.heuristic_outcomes", kafka2pc__transactional_id=tid) is None

    assert len(otel.spans("kafka2pc.prepare")) == 5
    assert len(otel.spans("kafka2pc.kafka_commit")) == 3
    assert len(otel.spans("kafka2pc.complete")) == 2
    prepare = otel.spans("kafka2pc.prepare")[-1]
    assert prepare.attributes is not None and prepare.attributes["kafka2pc.prepared_state"] == str(state)
    assert all(s.status.status_code is not StatusCode.ERROR for s in otel.spans())
    values = sorted(r.value for r in drain(kafka_bootstrap, topic) if r.value)
    assert values == [b"0", b"1", b"2", b"completed"]


def test_recovery_commit_and_a_failed_prepare_are_recorded(
    otel: Collected, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    """A second process's complete_transaction commits the prepared transaction: counted as a commit."""
    topic = topic_factory()
    tid = f"k2pc-otel-{uuid.uuid4().hex[:8]}"
    config = {"bootstrap.servers": kafka_bootstrap, "transactional.id": tid}
    first = TwoPhaseCommitProducer(config)
    first.init_transactions(30)
    first.begin_transaction()
    first.produce(topic, value=b"prepared-then-crashed")
    state = first.prepare_transaction(30)
    first.close()  # the "crash": the transaction stays prepared

    with otel.telemetry.instrument_producer(TwoPhaseCommitProducer(config)) as second:
        second.init_transactions(30, keep_prepared_txn=True)
        second.complete_transaction(state)
        assert otel.value(COMMITTED, kafka2pc__transactional_id=tid) == 1
        [span] = otel.spans("kafka2pc.complete")
        assert span.attributes is not None and span.attributes["kafka2pc.decision"] == "commit"

        second.begin_transaction()
        second.produce(f"{topic}-missing", value=b"x")  # no such topic: the flush cannot finish
        with pytest.raises(RetriableError):
            second.prepare_transaction(1)
        [failed] = otel.spans("kafka2pc.prepare")
        assert failed.status.status_code is StatusCode.ERROR
        assert failed.events and failed.events[0].name == "exception"
    assert [r.value for r in drain(kafka_bootstrap, topic)] == [b"prepared-then-crashed"]
