"""Every writer kind and both producers emit the documented metric and span names, against the real broker.

The names documented in docs/observability.md's table of instruments are
read from the page; each kind runs one committed and one rolled-back
transaction (on SQLite for the writers), with a collection while a
transaction is prepared, and what the in-memory OpenTelemetry SDK received
is compared with the page and with :data:`kafka2pc.otel.INSTRUMENTS`.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _otelkit import Collected
from kafka2pc.recipes.dual_write import DualWriter, Step, WriterPool, define_state_table

from kafka2pc import TwoPhaseCommitProducer
from kafka2pc.aio import AsyncTwoPhaseCommitProducer
from kafka2pc.otel import INSTRUMENTS, SPANS
from kafka2pc.testing import create_topic

DOCS = Path(__file__).resolve().parents[2] / "docs"
ALWAYS = {
    "kafka2pc.transactions.committed", "kafka2pc.transactions.aborted", "kafka2pc.transaction.prepare.duration",
    "kafka2pc.transaction.commit.duration", "kafka2pc.transaction.open.age", "kafka2pc.transaction.prepared.age",
    "kafka2pc.transactions.in_doubt",
}
"""What one committed and one rolled-back transaction, with a collection while prepared, emit for any kind."""
WRITERS = ALWAYS | {"kafka2pc.transaction.db_commit.duration"}


def documented_metrics() -> set[str]:
    page = (DOCS / "observability.md").read_text()
    section = page.split("### Instruments", 1)[1].split("###", 1)[0]
    return set(re.findall(r"^\| `(kafka2pc\.[a-z_.]+)` \|", section, re.MULTILINE))


def documented_spans() -> set[str]:
    page = (DOCS / "observability.md").read_text()
    section = page.split("### Spans", 1)[1].split("###", 1)[0]
    return set(re.findall(r"`(kafka2pc\.[a-z_.]+)`", section))


def test_the_table_of_names_is_the_documented_one() -> None:
    assert documented_metrics() == {i.name for i in INSTRUMENTS}
    assert documented_spans() <= set(SPANS)
    mentioned = set(re.findall(r"`(kafka2pc\.[a-z_]+\.[a-z_.]+)`", (DOCS / "dual-write.md").read_text()))
    metric_like = {n for n in mentioned if n.startswith(("kafka2pc.transaction", "kafka2pc.heuristic"))}
    assert metric_like and metric_like <= {i.name for i in INSTRUMENTS}


def _check(otel: Collected, during: set[str], expected: set[str], attrs: dict[str, str]) -> None:
    emitted = set(otel.points()) | during
    assert emitted <= documented_metrics(), emitted - documented_metrics()
    assert expected <= emitted, expected - emitted
    assert otel.value("kafka2pc.transactions.committed", **attrs) == 1
    assert otel.value("kafka2pc.transactions.aborted", **attrs) == 1
    spans = {s.name for s in otel.spans()} - {"caller"}
    assert spans <= set(SPANS) and "kafka2pc.prepare" in spans and "kafka2pc.kafka_commit" in spans


def test_sync_producer(otel: Collected, kafka_bootstrap: str) -> None:
    topic = create_topic(kafka_bootstrap)
    tid = f"k2pc-otel-p-{uuid.uuid4().hex[:8]}"
    with otel.telemetry.instrument_producer(
        TwoPhaseCommitProducer({"bootstrap.servers": kafka_bootstrap, "transactional.id": tid})
    ) as producer:
        producer.init_transactions()
        producer.begin_transaction()
        producer.produce(topic, b"one")
        producer.prepare_transaction()
        during = set(otel.points())
        producer.commit_transaction()
        producer.begin_transaction()
        producer.produce(topic, b"two")
        producer.abort_transaction()
    _check(otel, during, ALWAYS, {"kafka2pc__transactional_id": tid, "kafka2pc__component": "producer"})


def test_async_producer(otel: Collected, kafka_bootstrap: str) -> None:
    topic = create_topic(kafka_bootstrap)
    tid = f"k2pc-otel-ap-{uuid.uuid4().hex[:8]}"
    during: set[str] = set()

    async def main() -> None:
        async with otel.telemetry.instrument_producer(
            AsyncTwoPhaseCommitProducer({"bootstrap.servers": kafka_bootstrap, "transactional.id": tid})
        ) as producer:
            await producer.init_transactions()
            with otel.telemetry._tracer.start_as_current_span("caller"):
                await producer.begin_transaction()
                await producer.produce(topic, b"one")
                await producer.prepare_transaction()
            during.update(otel.points())
            await producer.commit_transaction()
            await producer.begin_transaction()
            await producer.produce(topic, b"two")
            await producer.abort_transaction()

    asyncio.run(main())
    _check(otel, during, ALWAYS, {"kafka2pc__transactional_id": tid, "kafka2pc__component": "producer"})
    caller = otel.spans("caller")[0]
    prepare = otel.spans("kafka2pc.prepare")[0]
    assert prepare.parent is not None and prepare.parent.span_id == caller.context.span_id  # the task's context


def _tables(url: str) -> tuple[sa.Table, sa.Table]:
    metadata = sa.MetaData()
    items = sa.Table("otel_items", metadata, sa.Column("id", sa.Integer, primary_key=True))
    states = define_state_table(metadata)
    engine = sa.create_engine(url)
    metadata.create_all(engine)
    engine.dispose()
    return items, states


def _collector(otel: Collected, during: set[str]) -> Callable[[Step], None]:
    def hook(step: Step) -> None:
        if step is Step.STATE_STORED and not during:
            during.update(otel.points())

    return hook


@pytest.mark.parametrize("kind", ["DualWriter", "WriterPool"])
def test_sync_writers(otel: Collected, kafka_bootstrap: str, tmp_path: Path, kind: str) -> None:
    topic = create_topic(kafka_bootstrap)
    url = f"sqlite:///{tmp_path / 'otel.db'}"
    items, states = _tables(url)
    engine = sa.create_engine(url)
    during: set[str] = set()
    name = f"k2pc-otel-{kind.lower()}-{uuid.uuid4().hex[:8]}"
    config: dict[str, Any] = {"bootstrap.servers": kafka_bootstrap}
    writer: Any
    if kind == "DualWriter":
        writer = DualWriter(engine, {**config, "transactional.id": name}, state_table=states,
                            on_step=_collector(otel, during))
        attrs = {"kafka2pc__transactional_id": name}
    else:
        writer = WriterPool(engine, config, prefix=name, size=2, max_slots=1, state_table=states,
                            on_step=_collector(otel, during), start=False)
        writer.create_tables()
        writer.start()
        attrs = {"kafka2pc__pool": name}
    otel.telemetry.instrument_dual_writer(writer)
    try:
        with engine.connect() as conn, writer.transaction(conn) as tx:
            conn.execute(items.insert().values(id=1))
            tx.produce(topic, b"one")
        with pytest.raises(ZeroDivisionError), engine.connect() as conn, writer.transaction(conn) as tx:
            tx.produce(topic, b"two")
            1 / 0  # noqa: B018
    finally:
        writer.close()
        engine.dispose()
    _check(otel, during, WRITERS, {**attrs, "kafka2pc__component": "dual_write"})
    assert "kafka2pc.recovery" in {s.name for s in otel.spans()}


@pytest.mark.parametrize("kind", ["AsyncDualWriter", "AsyncWriterPool"])
def test_async_writers(otel: Collected, kafka_bootstrap: str, tmp_path: Path, kind: str) -> None:
    from kafka2pc.recipes.dual_write.aio import AsyncDualWriter, AsyncWriterPool
    from sqlalchemy.ext.asyncio import create_async_engine

    topic = create_topic(kafka_bootstrap)
    items, states = _tables(f"sqlite:///{tmp_path / 'otel.db'}")
    during: set[str] = set()
    name = f"k2pc-otel-{kind.lower()}-{uuid.uuid4().hex[:8]}"
    config: dict[str, Any] = {"bootstrap.servers": kafka_bootstrap}
    attrs = {"kafka2pc__transactional_id": name} if kind == "AsyncDualWriter" else {"kafka2pc__pool": name}

    async def main() -> Any:
        engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'otel.db'}")
        writer: Any
        if kind == "AsyncDualWriter":
            writer = AsyncDualWriter(engine, {**config, "transactional.id": name}, state_table=states,
                                     on_step=_collector(otel, during))
        else:
            writer = AsyncWriterPool(engine, config, prefix=name, size=2, max_slots=1, state_table=states,
                                     on_step=_collector(otel, during))
            await writer.create_tables()
        otel.telemetry.instrument_dual_writer(writer)
        try:
            async with engine.connect() as conn, writer.transaction(conn) as tx:
                await conn.execute(items.insert().values(id=1))
                await tx.produce(topic, b"one")
            with pytest.raises(ZeroDivisionError):
                async with engine.connect() as conn, writer.transaction(conn) as tx:
                    await tx.produce(topic, b"two")
                    1 / 0  # noqa: B018
        finally:
            await writer.close()
            await engine.dispose()
        return writer

    kept = asyncio.run(main())  # kept: the counters are read from the writer's metrics at each collection
    _check(otel, during, WRITERS, {**attrs, "kafka2pc__component": "dual_write"})
    snapshot = kept.metrics()
    assert getattr(snapshot, "transactions", snapshot).transactions_committed == 1


def test_anything_else_is_refused(otel: Collected) -> None:
    with pytest.raises(TypeError, match="DualWriter, WriterPool"):
        otel.telemetry.instrument_dual_writer(object())


def test_the_public_names_of_kafka2pc_otel() -> None:
    import kafka2pc.otel

    assert kafka2pc.otel.__all__ == [
        "ATTRIBUTES", "INSTRUMENTS", "SCOPE", "SPANS", "Instrument", "Telemetry",
        "instrument_dual_writer", "instrument_producer", "instrument_spark_sink",
    ]
    assert len({i.name for i in INSTRUMENTS}) == len(INSTRUMENTS) and all(i.name.startswith("kafka2pc.")
                                                                          for i in INSTRUMENTS)
