"""OpenTelemetry for both Spark paths (foreachBatch and format("kafka2pc")), against the real broker and a local SparkSession."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pytest
from _otelkit import Collected
from kafka2pc.recipes.spark import KafkaTwoPhaseSink, register_data_source
from kafka2pc.recipes.spark._executor import WriterSpec, write_partition

from kafka2pc.testing import create_topic, drain

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def test_spark_batches_become_counters_histograms_and_spans(
    otel: Collected, spark: SparkSession, kafka_bootstrap: str, tmp_path: Path
) -> None:
    out = create_topic(kafka_bootstrap, partitions=2)
    sink_id = f"otel-{uuid.uuid4().hex[:8]}"
    # A leftover prepared transaction of a "crashed run" under the sink's ids: aborted before the first write.
    spec = WriterSpec({"bootstrap.servers": kafka_bootstrap}, f"kafka2pc-spark-{sink_id}", out, ("value",), 0)
    write_partition(spec, [pa.RecordBatch.from_pydict({"value": [b"stale"] * 5})], 4, 0)

    sink = KafkaTwoPhaseSink({"bootstrap.servers": kafka_bootstrap}, topic=out, sink_id=sink_id,
                             checkpoint_location=str(tmp_path / "chk"))
    foreach_batch = otel.telemetry.instrument_spark_sink(sink)
    assert foreach_batch is sink and isinstance(sink, KafkaTwoPhaseSink)  # instrumented in place, as a writer
    df = spark.range(0, 300, numPartitions=3).selectExpr("CAST(id AS STRING) AS value")
    foreach_batch(df, 0)
    foreach_batch(df, 0)  # a replay: completed, not written again
    sink.close()

    attrs = {"kafka2pc__component": "spark_sink", "kafka2pc__sink_id": sink_id}
    assert otel.value("kafka2pc.transactions.committed", **attrs) == 3
    assert otel.value("kafka2pc.transactions.aborted", **attrs) == 1
    assert otel.histogram("kafka2pc.transaction.prepare.duration", **attrs)[0] == 1  # the replay prepares nothing
    assert otel.histogram("kafka2pc.transaction.db_commit.duration", **attrs)[0] == 1
    count, total = otel.histogram("kafka2pc.transaction.commit.duration", **attrs)
    assert count == 2 and total > 0
    assert otel.value("kafka2pc.transaction.open.age", **attrs) is None  # no batch in progress
    assert otel.value("kafka2pc.transactions.in_doubt", **attrs) == 0
    assert otel.value("kafka2pc.heuristic_outcomes", **attrs) is None

    batches = otel.spans("kafka2pc.spark.batch")
    assert len(batches) == 2
    first = batches[0]
    children = [s for s in otel.spans() if s.parent is not None and s.parent.span_id == first.context.span_id]
    assert [s.name for s in sorted(children, key=lambda s: s.start_time or 0)] == [
        "kafka2pc.prepare", "kafka2pc.db_commit", "kafka2pc.kafka_commit",
    ]
    for span in children:
        assert first.start_time is not None and first.end_time is not None
        assert span.start_time is not None and span.end_time is not None
        assert first.start_time <= span.start_time <= span.end_time <= first.end_time
    replay_children = [s for s in otel.spans() if s.parent is not None and s.parent.span_id == batches[1].context.span_id]
    assert [s.name for s in replay_children] == ["kafka2pc.kafka_commit"]
    assert sorted(int(r.value) for r in drain(kafka_bootstrap, out) if r.value) == list(range(300))


def test_a_repaired_partition_counts_as_a_repaired_heuristic_outcome(
    otel: Collected, spark: SparkSession, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A late duplicate attempt aborts the decided transaction of partition 0: the sink writes it again."""
    from kafka2pc.recipes.spark._faults import FaultInjection, inject_task_hook

    out = create_topic(kafka_bootstrap, partitions=2)
    faults = FaultInjection(duplicate_attempt="after_prepare", fail_partitions=(0,))
    sink = inject_task_hook(
        KafkaTwoPhaseSink({"bootstrap.servers": kafka_bootstrap}, topic=out, checkpoint_location=str(tmp_path / "chk")),
        faults,
    )
    foreach_batch = otel.telemetry.instrument_spark_sink(sink)
    foreach_batch(spark.range(0, 100, numPartitions=2).selectExpr("CAST(id AS STRING) AS value"), 0)
    sink.close()
    batch = sink.last_batch_metrics
    assert batch is not None and batch.repaired_partitions == (0,)
    assert otel.value("kafka2pc.heuristic_outcomes", kafka2pc__component="spark_sink", kafka2pc__repaired=True) == 1
    assert sorted(int(r.value) for r in drain(kafka_bootstrap, out) if r.value) == list(range(100))


def test_the_data_source_records_the_same_names(
    otel: Collected, spark: SparkSession, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """format("kafka2pc"): the monitor register_data_source returns is instrumented as a sink is."""
    import pyspark

    if int(pyspark.__version__.split(".")[0]) < 4:
        pytest.fail("format('kafka2pc') needs PySpark 4: run this module on PySpark 4")
    out = create_topic(kafka_bootstrap, partitions=2)
    monitor = register_data_source(spark)
    assert otel.telemetry.instrument_spark_sink(monitor) is monitor
    try:
        (spark.range(0, 300, numPartitions=3).selectExpr("CAST(id AS STRING) AS value").write.format("kafka2pc")
         .option("kafka.bootstrap.servers", kafka_bootstrap).option("topic", out)
         .option("kafka2pc.decisionPath", str(tmp_path / "d")).mode("append").save())
    finally:
        monitor._listeners.clear()  # the monitor is the process's: no listener of this test's providers stays
    (sink_dir,) = (tmp_path / "d").iterdir()
    attrs = {"kafka2pc__component": "spark_sink", "kafka2pc__sink_id": sink_dir.name}
    assert otel.value("kafka2pc.transactions.committed", **attrs) == 3
    assert otel.histogram("kafka2pc.transaction.prepare.duration", **attrs)[0] == 1
    assert otel.histogram("kafka2pc.transaction.db_commit.duration", **attrs)[0] == 1
    assert otel.histogram("kafka2pc.transaction.commit.duration", **attrs)[0] == 1
    assert otel.value("kafka2pc.transactions.in_doubt", **attrs) == 0
    (batch,) = otel.spans("kafka2pc.spark.batch")
    children = [s for s in otel.spans() if s.parent is not None and s.parent.span_id == batch.context.span_id]
    assert [s.name for s in sorted(children, key=lambda s: s.start_time or 0)] == [
        "kafka2pc.prepare", "kafka2pc.db_commit", "kafka2pc.kafka_commit",
    ]
    assert sorted(int(r.value) for r in drain(kafka_bootstrap, out) if r.value) == list(range(300))
