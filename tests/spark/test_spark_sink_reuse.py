"""One KafkaTwoPhaseSink object used by more than one streaming query (issue 12, item 2).

A sink that derives its id and decision store from the checkpoint serves
every query with its own ids and decisions, one after the other or at the
same time; a sink tied to one query (explicit ``sink_id``) refuses another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _sparkkit import assert_exactly_once
from kafka2pc.recipes.spark import KafkaTwoPhaseSink, LocalDecisionStore

from kafka2pc.testing import drain

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def start_query(
    spark: SparkSession, sink: Callable[[Any, int], None], checkpoint: Path, prefix: str, rows: int,
    last_batch: int,
) -> tuple[Any, threading.Event]:
    """A ``rate-micro-batch`` query writing ``<prefix><n>`` for batches 0..last_batch through ``sink``."""
    done = threading.Event()

    def foreach_batch(df: Any, batch_id: int) -> None:
        if batch_id <= last_batch:
            sink(df, batch_id)
        if batch_id >= last_batch:
            done.set()

    query = (
        spark.readStream.format("rate-micro-batch").option("rowsPerBatch", rows).option("numPartitions", 2).load()
        .selectExpr(f"CONCAT('{prefix}', CAST(value AS STRING)) AS value")
        .writeStream.foreachBatch(foreach_batch)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    return query, done


def wait_for(query: Any, done: threading.Event, timeout: float = 180) -> BaseException | None:
    """Wait until the query reached its last batch or failed; stop it; return its error."""
    deadline = time.monotonic() + timeout
    try:
        while not done.is_set() and query.isActive and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        query.stop()
    error: BaseException | None = query.exception()
    return error


def values(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def decided_batches(checkpoint: Path) -> tuple[str, list[int]]:
    """The sink id that wrote decisions under ``checkpoint``, and the batch ids it decided."""
    (sink_dir,) = (checkpoint / "kafka2pc").iterdir()
    store = LocalDecisionStore(sink_dir)
    return sink_dir.name, sorted(b for b in range(10) if store.get(b) is not None)


def test_one_sink_serves_two_queries_one_after_the_other(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path
) -> None:
    """Query B, started after A with the same sink object, writes its own rows (B's batch 0 is not A's)."""
    out = topic_factory(partitions=2)
    sink = KafkaTwoPhaseSink({"bootstrap.servers": kafka_bootstrap}, topic=out)
    assert wait_for(*start_query(spark, sink, tmp_path / "chk-a", "a", 200, 2)) is None
    assert wait_for(*start_query(spark, sink, tmp_path / "chk-b", "b", 150, 1)) is None

    id_a, batches_a = decided_batches(tmp_path / "chk-a")
    id_b, batches_b = decided_batches(tmp_path / "chk-b")
    assert id_a != id_b
    assert batches_a == [0, 1, 2] and batches_b == [0, 1]  # B's checkpoint has its own decisions
    assert [(m.batch_id, m.replayed) for m in sink.metrics()] == [(0, False), (1, False), (2, False),
                                                                 (0, False), (1, False)]
    assert_exactly_once(kafka_bootstrap, out, values("a", 600) + values("b", 300))


def test_one_sink_serves_two_queries_at_the_same_time(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path
) -> None:
    """Two queries running concurrently through one sink object: each batch of each lands exactly once."""
    out = topic_factory(partitions=2)
    sink = KafkaTwoPhaseSink({"bootstrap.servers": kafka_bootstrap}, topic=out)
    a = start_query(spark, sink, tmp_path / "chk-a", "a", 200, 3)
    b = start_query(spark, sink, tmp_path / "chk-b", "b", 100, 3)
    assert wait_for(*a) is None and wait_for(*b) is None

    id_a, batches_a = decided_batches(tmp_path / "chk-a")
    id_b, batches_b = decided_batches(tmp_path / "chk-b")
    assert id_a != id_b and batches_a == batches_b == [0, 1, 2, 3]
    assert sorted(m.batch_id for m in sink.metrics()) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert not any(m.replayed for m in sink.metrics())
    assert_exactly_once(kafka_bootstrap, out, values("a", 800) + values("b", 400))


def test_sink_tied_to_one_query_refuses_another(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path
) -> None:
    """With an explicit sink_id the ids are the query's: a second query fails with a clear error, writes nothing."""
    out = topic_factory(partitions=2)
    sink = KafkaTwoPhaseSink({"bootstrap.servers": kafka_bootstrap}, topic=out, sink_id="tied-to-a")
    assert wait_for(*start_query(spark, sink, tmp_path / "chk-a", "a", 100, 1)) is None

    error = wait_for(*start_query(spark, sink, tmp_path / "chk-b", "b", 100, 1))
    assert error is not None
    assert "one KafkaTwoPhaseSink per query" in str(error) and "sink_id" in str(error)
    assert not (tmp_path / "chk-b" / "kafka2pc").exists()
    assert_exactly_once(kafka_bootstrap, out, values("a", 200))
    assert len(drain(kafka_bootstrap, out, "read_uncommitted")) == 200  # B did not even write uncommitted rows
