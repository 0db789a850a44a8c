"""A batch that fails before its decision leaves no transaction open (issue 12, item 3).

The failed batch's prepared transactions are aborted before the error
propagates, so read_committed readers of the partitions they touched (and
other applications writing there) are not held back; a missing topic fails
fast, with an error that names it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from _sparkkit import assert_exactly_once, hanging
from confluent_kafka import Producer
from kafka2pc.recipes.spark import KafkaTwoPhaseSink, SinkRecovery, SinkWriteError, UnknownTopicError
from kafka2pc.recipes.spark._executor import WriterSpec, write_partition
from kafka2pc.recipes.spark._faults import FaultInjection, inject_task_hook

from kafka2pc import UsageError
from kafka2pc.testing import drain

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def other_application_writes(bootstrap: str, topic: str, partitions: int, tag: str) -> list[bytes]:
    """A transactional producer of another application commits one record per partition."""
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"other-app-{uuid.uuid4().hex}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    written = [f"{tag}-{p}".encode() for p in range(partitions)]
    for p, value in enumerate(written):
        producer.produce(topic, value=value, partition=p)
    producer.commit_transaction(30)
    return written


def test_row_naming_a_missing_topic_fails_fast_names_it_and_leaves_nothing_open(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path
) -> None:
    out = topic_factory(partitions=3)
    missing = f"no-such-topic-{uuid.uuid4().hex[:8]}"
    sink = KafkaTwoPhaseSink({"bootstrap.servers": kafka_bootstrap}, checkpoint_location=str(tmp_path / "chk"))
    df = spark.range(0, 300, numPartitions=3).selectExpr(
        f"IF(id = 250, '{missing}', '{out}') AS topic", "CAST(id AS STRING) AS value",
        "CAST(id % 3 AS INT) AS partition",
    )
    started = time.monotonic()
    with pytest.raises(UnknownTopicError, match=missing) as raised:
        sink(df, 0)
    elapsed = time.monotonic() - started
    assert isinstance(raised.value, UsageError)
    assert elapsed < 30, f"a missing topic took {elapsed:.1f}s to fail"
    # The two partitions that prepared were aborted: nothing is held back...
    assert hanging(kafka_bootstrap, out) == 0
    assert drain(kafka_bootstrap, out, "read_committed") == []
    # ... so another application's committed writes to every partition are readable at once.
    theirs = other_application_writes(kafka_bootstrap, out, 3, "other")
    assert sorted(r.value for r in drain(kafka_bootstrap, out, "read_committed")) == sorted(theirs)

    # The operator's recover() after the failure: for the sink's own query, and from a new driver
    # process's sink given the checkpoint location (nothing is left open: both find nothing to do).
    assert sink.recover(spark) == SinkRecovery()
    assert KafkaTwoPhaseSink({"bootstrap.servers": kafka_bootstrap}).recover(
        spark, checkpoint_location=str(tmp_path / "chk")) == SinkRecovery()
    # The same batch with the topic fixed is written exactly once afterwards.
    sink(spark.range(0, 300, numPartitions=3).selectExpr("CAST(id AS STRING) AS value")
         .selectExpr(f"'{out}' AS topic", "value"), 0)
    assert_exactly_once(kafka_bootstrap, out, theirs + [str(i).encode() for i in range(300)])


def test_missing_topic_option_fails_before_writing(
    spark: SparkSession, kafka_bootstrap: str, tmp_path: Path
) -> None:
    missing = f"no-such-topic-{uuid.uuid4().hex[:8]}"
    sink = KafkaTwoPhaseSink({"bootstrap.servers": kafka_bootstrap}, topic=missing,
                             checkpoint_location=str(tmp_path / "chk"))
    started = time.monotonic()
    with pytest.raises(UnknownTopicError, match=missing):
        sink(spark.range(10).selectExpr("CAST(id AS STRING) AS value"), 0)
    assert time.monotonic() - started < 10
    assert sink.decision_store is not None and sink.decision_store.get(0) is None
    assert sink.recover(spark) == SinkRecovery()  # the operator's call after the failure works


def test_recover_after_the_query_stopped_ends_what_it_left_open(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path
) -> None:
    """A streaming query fails in a batch whose tasks prepared (no value column reaches the tasks' checks).

    Its sink (sink_id given, so tied to the query) and a new driver's sink given only the checkpoint
    location both recover; nothing is left open and the next run writes exactly once.
    """
    import pyarrow as pa

    out = topic_factory(partitions=2)
    chk = tmp_path / "chk"
    sink_id = f"rec-{uuid.uuid4().hex[:8]}"
    sink = KafkaTwoPhaseSink({"bootstrap.servers": kafka_bootstrap}, sink_id=sink_id, checkpoint_location=str(chk))
    query = (
        spark.readStream.format("rate-micro-batch").option("rowsPerBatch", 10).load()
        .selectExpr("CAST(value AS STRING) AS value")  # no topic column, no topic option: the batch fails
        .writeStream.foreachBatch(sink).option("checkpointLocation", str(chk)).start()
    )
    with pytest.raises(Exception, match="topic"):
        query.awaitTermination(60)
    # What a killed task of that query would have left: a prepared transaction under the sink's ids.
    spec = WriterSpec({"bootstrap.servers": kafka_bootstrap}, f"kafka2pc-spark-{sink_id}", out, ("value",), 0)
    write_partition(spec, [pa.RecordBatch.from_pydict({"value": [b"stale"] * 20})], 1, 0)
    assert hanging(kafka_bootstrap, out) == 20
    assert sink.recover(spark) == SinkRecovery(aborted=1)
    assert hanging(kafka_bootstrap, out) == 0
    write_partition(spec, [pa.RecordBatch.from_pydict({"value": [b"stale"] * 20})], 0, 0)
    fresh = KafkaTwoPhaseSink({"bootstrap.servers": kafka_bootstrap}, sink_id=sink_id)
    assert fresh.recover(spark, checkpoint_location=str(chk)) == SinkRecovery(aborted=1)
    assert hanging(kafka_bootstrap, out) == 0 and drain(kafka_bootstrap, out, "read_committed") == []


def test_failed_task_after_other_partitions_prepared_aborts_them_all(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path
) -> None:
    """Partition 1 fails on every attempt after preparing; partitions 0 and 2 prepared: all are aborted."""
    out = topic_factory(partitions=3)
    faults = FaultInjection(fail_task_at="after_prepare", fail_task_attempts=99, fail_partitions=(1,))
    sink = inject_task_hook(KafkaTwoPhaseSink({"bootstrap.servers": kafka_bootstrap}, topic=out,
                                              checkpoint_location=str(tmp_path / "chk")), faults)
    df = spark.range(0, 300, numPartitions=3).selectExpr("CAST(id AS STRING) AS value")
    with pytest.raises(SinkWriteError, match="fault injection") as raised:
        sink(df, 0)
    assert "aborted" in str(raised.value)
    assert hanging(kafka_bootstrap, out) == 0, "a prepared transaction of the failed batch is still open"
    assert drain(kafka_bootstrap, out, "read_committed") == []
    assert len(drain(kafka_bootstrap, out, "read_uncommitted")) >= 300  # it did write, and it was aborted
    theirs = other_application_writes(kafka_bootstrap, out, 3, "other")
    assert sorted(r.value for r in drain(kafka_bootstrap, out, "read_committed")) == sorted(theirs)
