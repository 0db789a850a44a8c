"""OpenTelemetry for the dual write, against the real broker, on PostgreSQL and SQLite."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from _otelkit import Collected
from kafka2pc.recipes.dual_write import DualWriter, Step, define_state_table
from opentelemetry.trace import StatusCode

from kafka2pc import TransactionAdmin
from kafka2pc.testing import create_topic, drain

COMMITTED = "kafka2pc.transactions.committed"
ABORTED = "kafka2pc.transactions.aborted"


class _Crash(Exception):
    pass


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(db_url)
    yield engine
    engine.dispose()


def test_dual_write_transactions_become_counters_histograms_gauges_and_spans(
    otel: Collected, engine: sa.Engine, kafka_bootstrap: str
) -> None:
    topic = create_topic(kafka_bootstrap)
    tid = f"k2pc-otel-dw-{uuid.uuid4().hex[:8]}"
    metadata = sa.MetaData()
    items = sa.Table(f"otel_items_{uuid.uuid4().hex[:6]}", metadata, sa.Column("id", sa.Integer, primary_key=True))
    states = define_state_table(metadata, f"otel_state_{uuid.uuid4().hex[:6]}")
    metadata.create_all(engine)
    seen: list[Step] = []
    during: dict[str, Any] = {}

    def user_hook(step: Step) -> None:  # the application's own hook still runs
        seen.append(step)
        if step is Step.STATE_STORED and "prepared_age" not in during:
            during["prepared_age"] = otel.value("kafka2pc.transaction.prepared.age", kafka2pc__transactional_id=tid)
            during["open_age"] = otel.value("kafka2pc.transaction.open.age", kafka2pc__transactional_id=tid)
            during["in_doubt"] = otel.value("kafka2pc.transactions.in_doubt", kafka2pc__transactional_id=tid)

    config = {"bootstrap.servers": kafka_bootstrap, "transactional.id": tid}
    writer = otel.telemetry.instrument_dual_writer(DualWriter(engine, config, state_table=states, on_step=user_hook))
    with writer:
        writer.recover()
        for i in range(3):
            with engine.connect() as conn, writer.transaction(conn) as tx:
                conn.execute(items.insert().values(id=i))
                tx.produce(topic, value=b"%d" % i)
        with pytest.raises(ZeroDivisionError), engine.connect() as conn, writer.transaction(conn) as tx:
            tx.produce(topic, value=b"rolled back")
            1 / 0  # noqa: B018 - the application fails: both sides roll back

        assert Step.KAFKA_COMMITTED in seen and Step.STATE_STORED in seen
        assert during["prepared_age"] is not None and during["prepared_age"] >= 0
        assert during["open_age"] is not None and during["open_age"] >= during["prepared_age"]
        assert during["in_doubt"] == 0
        attrs = {"kafka2pc__transactional_id": tid, "kafka2pc__component": "dual_write"}
        assert otel.value(COMMITTED, **attrs) == 3
        assert otel.value(ABORTED, **attrs) == 1
        assert otel.histogram("kafka2pc.transaction.prepare.duration", **attrs)[0] == 3
        assert otel.histogram("kafka2pc.transaction.db_commit.duration", **attrs)[0] == 3
        assert otel.histogram("kafka2pc.transaction.commit.duration", **attrs)[0] == 3
        assert otel.value("kafka2pc.transaction.open.age", **attrs) is None  # nothing open between transactions
        assert otel.value("kafka2pc.transaction.prepared.age", **attrs) is None
        assert otel.value("kafka2pc.transactions.in_doubt", **attrs) == 0

        # A crash between the two commits, then Kafka aborts the prepared transaction behind the
        # database's back (an operator's force-terminate): recovery finds a heuristic outcome.
        def crash_after_db_commit(_writer: object, step: Step) -> None:
            if step is Step.DB_COMMITTED:
                raise _Crash()

        writer.add_listener("step", crash_after_db_commit)
        with pytest.raises(_Crash), engine.connect() as conn, writer.transaction(conn) as tx:
            conn.execute(items.insert().values(id=99))
            tx.produce(topic, value=b"heuristic")
        writer.remove_listener("step", crash_after_db_commit)
        with TransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:
            assert admin.force_terminate_transaction(tid) is not None
        result = writer.recover(on_heuristic="report")
        assert result.heuristic
        assert otel.value("kafka2pc.heuristic_outcomes", **attrs) == 1

    names = [s.name for s in otel.spans()]
    assert names.count("kafka2pc.prepare") == 4 and names.count("kafka2pc.db_commit") == 4
    assert names.count("kafka2pc.kafka_commit") == 4 and names.count("kafka2pc.recovery") == 2
    interrupted = otel.spans("kafka2pc.kafka_commit")[-1]  # the crash came before the Kafka commit
    assert interrupted.status.status_code is StatusCode.ERROR
    assert all(s.status.status_code is not StatusCode.ERROR for s in otel.spans("kafka2pc.kafka_commit")[:3])
    db_commit = otel.spans("kafka2pc.db_commit")[0]
    assert db_commit.attributes is not None and db_commit.attributes["kafka2pc.transactional_id"] == tid
    assert sorted(r.value for r in drain(kafka_bootstrap, topic) if r.value) == [b"0", b"1", b"2"]
