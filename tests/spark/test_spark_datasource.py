"""format("kafka2pc") in the shared local SparkSession: batch reruns, task retries, columns, bad input, streaming.

Every test writes through a real broker and checks with a read_committed
consumer that each input row is visible exactly once and that no transaction
is left open (last stable offset == high watermark).  PySpark 4 only
(tests/spark/conftest.py leaves this module out on older lines).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _sparkkit import assert_exactly_once, hanging, write_json_files
from kafka2pc.recipes.spark import FaultInjection, LocalDecisionStore, SinkStep
from kafka2pc.recipes.spark.datasource import Kafka2pcDataSource, recover, register_data_source

from kafka2pc import TransactionAdmin
from kafka2pc.testing import drain

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


@pytest.fixture
def kafka2pc_format(spark: SparkSession) -> Iterator[Callable[[type[Kafka2pcDataSource]], None]]:
    """Register the data source (or a subclass with test hooks) as "kafka2pc"; the plain one again afterwards."""
    register_data_source(spark)
    yield lambda cls: spark.dataSource.register(cls)
    register_data_source(spark)


def values(n: int, start: int = 0) -> list[bytes]:
    return [str(i).encode() for i in range(start, start + n)]


def batch_write(df: DataFrame, bootstrap: str, topic: str | None, **options: str) -> None:
    writer = df.write.format("kafka2pc").option("kafka.bootstrap.servers", bootstrap)
    if topic is not None:
        writer = writer.option("topic", topic)
    for key, value in options.items():
        writer = writer.option(key, value)
    writer.mode("append").save()


def test_batch_rerun_with_the_same_run_id_writes_nothing(
    spark: SparkSession, kafka2pc_format: Any, kafka_bootstrap: str, topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:
    out = topic_factory(partitions=2)
    df = spark.range(0, 500, numPartitions=3).selectExpr("CAST(id AS STRING) AS value", "CAST(id % 5 AS STRING) AS key")
    run = {"kafka2pc.runId": f"run-{uuid.uuid4().hex[:6]}", "kafka2pc.decisionPath": str(tmp_path / "d")}
    batch_write(df, kafka_bootstrap, out, **run)
    assert_exactly_once(kafka_bootstrap, out, values(500))
    (sink_dir,) = (tmp_path / "d").iterdir()
    decision = LocalDecisionStore(sink_dir).get(0)
    assert decision is not None and len(decision.transactions) == 3 and decision.revision == 0

    batch_write(df, kafka_bootstrap, out, **run)  # the rerun: nothing written, nothing prepared
    assert_exactly_once(kafka_bootstrap, out, values(500))
    assert len(drain(kafka_bootstrap, out, "read_uncommitted")) == 500
    assert sorted(p.name for p in sink_dir.iterdir()) == ["0000000000000000000.000000.json"]

    # Another run id is another run: written once more.
    batch_write(df, kafka_bootstrap, out, **dict(run, **{"kafka2pc.runId": "other"}))
    assert sorted(r.value for r in drain(kafka_bootstrap, out, "read_committed")) == sorted(values(500) * 2)


def test_batch_commit_failing_after_its_decision_still_commits_and_the_rerun_writes_nothing(
    spark: SparkSession, kafka2pc_format: Any, kafka_bootstrap: str, topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:
    """The driver's commit raises right after the decision (test_spark_datasource_crash.py kills it there).

    The decision is the commit point: Spark then calls the writer's abort, which settles the open
    transactions with the latest decision, so they commit; the rerun finds the run committed.
    """

    def die_after_decision(step: SinkStep, batch_id: int) -> None:
        if step is SinkStep.AFTER_DECISION:
            raise RuntimeError("the driver dies after the decision")

    class Dying(Kafka2pcDataSource):
        _on_step = die_after_decision

    out = topic_factory(partitions=2)
    df = spark.range(0, 300, numPartitions=3).selectExpr("CAST(id AS STRING) AS value")
    run = {"kafka2pc.runId": "died", "kafka2pc.decisionPath": str(tmp_path / "d")}
    kafka2pc_format(Dying)
    with pytest.raises(Exception, match="dies after the decision"):
        batch_write(df, kafka_bootstrap, out, **run)
    assert_exactly_once(kafka_bootstrap, out, values(300))
    kafka2pc_format(Kafka2pcDataSource)
    batch_write(df, kafka_bootstrap, out, **run)  # the run is committed: writes nothing
    assert_exactly_once(kafka_bootstrap, out, values(300))
    assert len(drain(kafka_bootstrap, out, "read_uncommitted")) == 300


def test_batch_task_retry_after_prepare_gives_each_row_once(
    spark: SparkSession, kafka2pc_format: Any, kafka_bootstrap: str, topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:
    """Attempt 0 of partition 1 prepares and fails; its retry (its own transactional id) is the one committed."""

    class Failing(Kafka2pcDataSource):
        _task_hook = FaultInjection(fail_task_at="after_prepare", fail_task_attempts=1, fail_partitions=(1,))

    kafka2pc_format(Failing)
    out = topic_factory(partitions=2)
    df = spark.range(0, 300, numPartitions=3).selectExpr("CAST(id AS STRING) AS value")
    batch_write(df, kafka_bootstrap, out, **{"kafka2pc.decisionPath": str(tmp_path / "d")})
    (sink_dir,) = (tmp_path / "d").iterdir()
    decision = LocalDecisionStore(sink_dir).get(0)
    assert decision is not None
    assert {t.partition: t.transactional_id.rsplit(".", 1)[1] for t in decision.transactions} == {
        0: "0", 1: "1", 2: "0"}  # partition 1's result came from attempt 1
    assert_exactly_once(kafka_bootstrap, out, values(300))


def test_columns_and_bad_input(
    spark: SparkSession, kafka2pc_format: Any, kafka_bootstrap: str, topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:
    """Spark's Kafka sink columns reach Kafka as given; bad input fails fast, leaves nothing, recover works."""
    t1, t2 = topic_factory(partitions=3), topic_factory(partitions=3)
    opts = {"kafka2pc.decisionPath": str(tmp_path / "d")}
    df = spark.range(0, 60, numPartitions=2).selectExpr(
        f"IF(id % 2 = 0, '{t1}', '{t2}') AS topic", "CAST(id AS STRING) AS key",
        "CAST(CONCAT('v', id) AS BINARY) AS value", "CAST(id % 3 AS INT) AS partition",
        "ARRAY(NAMED_STRUCT('key', 'id', 'value', CAST(CAST(id AS STRING) AS BINARY))) AS headers",
    )
    batch_write(df, kafka_bootstrap, None, **opts)
    from test_spark_sink import _consume_with_headers

    for topic in (t1, t2):
        for msg in _consume_with_headers(kafka_bootstrap, topic, 30):
            i = int(msg.key())
            assert (msg.topic(), msg.partition(), msg.value()) == ((t1 if i % 2 == 0 else t2), i % 3, f"v{i}".encode())
            assert msg.headers() == [("id", str(i).encode())]

    missing = f"no-such-topic-{uuid.uuid4().hex[:8]}"
    cases: list[tuple[str, DataFrame, str | None, dict[str, str], str]] = [
        ("no value column", spark.range(3).selectExpr("CAST(id AS STRING) AS key"), t1, {}, "'value'"),
        ("no topic", spark.range(3).selectExpr("CAST(id AS STRING) AS value"), None, {}, "topic option required"),
        ("missing topic option", spark.range(3).selectExpr("CAST(id AS STRING) AS value"), missing, {}, missing),
        ("null topic", spark.range(0, 90, numPartitions=3).selectExpr(
            f"IF(id = 80, NULL, '{t1}') AS topic", "CAST(id AS STRING) AS value"), None, {}, "null topic"),
        ("missing topic in a row", spark.range(0, 90, numPartitions=3).selectExpr(
            f"IF(id = 80, '{missing}', '{t1}') AS topic", "CAST(id AS STRING) AS value"), None, {}, missing),
        ("unreachable bootstrap", spark.range(3).selectExpr("CAST(id AS STRING) AS value"), t1,
         {"kafka.bootstrap.servers": "127.0.0.1:9", "kafka.socket.connection.setup.timeout.ms": "1000"},
         "127.0.0.1:9|ransport|onnect|nreachable|timed out|BrokerUnavailable"),
    ]
    before = {t: len(drain(kafka_bootstrap, t, "read_committed")) for t in (t1, t2)}
    for name, bad, topic, extra, error in cases:
        started = time.monotonic()
        with pytest.raises(Exception, match=error):
            batch_write(bad, extra.get("kafka.bootstrap.servers", kafka_bootstrap), topic, **dict(opts, **extra))
        elapsed = time.monotonic() - started
        assert elapsed < 60, f"{name}: took {elapsed:.1f}s to fail"
        for t in (t1, t2):
            assert hanging(kafka_bootstrap, t) == 0, f"{name}: a transaction is left open on {t}"
            assert len(drain(kafka_bootstrap, t, "read_committed")) == before[t], f"{name}: rows became visible"
    # recover afterwards: every sink id under the decision path has nothing open, and a good write works.
    with TransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:
        assert not [t for t in admin.list_transactions() if t.transactional_id.startswith("kafka2pc-spark-r")
                    and t.state not in ("Empty", "CompleteCommit", "CompleteAbort", "Dead")]
    batch_write(spark.range(0, 10).selectExpr("CAST(id AS STRING) AS value"), kafka_bootstrap, t1, **opts)
    assert len(drain(kafka_bootstrap, t1, "read_committed")) == before[t1] + 10


def test_streaming_micro_batches_exactly_once_with_task_retries(
    spark: SparkSession, kafka2pc_format: Any, kafka_bootstrap: str, topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:
    """JSON files into writeStream.format("kafka2pc") (AvailableNow); attempt 0 of partition 0 fails after preparing."""

    class Failing(Kafka2pcDataSource):
        _task_hook = FaultInjection(fail_task_at="after_prepare", fail_task_attempts=1, fail_partitions=(0,))

    kafka2pc_format(Failing)
    out = topic_factory(partitions=2)
    expected = write_json_files(tmp_path / "in", [100] * 6)
    chk = tmp_path / "chk"
    options = {"kafka.bootstrap.servers": kafka_bootstrap, "topic": out, "checkpointLocation": str(chk)}
    query = (
        spark.readStream.schema("id long, v string").option("maxFilesPerTrigger", 2).json(str(tmp_path / "in"))
        .selectExpr("CAST(id % 7 AS STRING) AS key", "v AS value")
        .writeStream.format("kafka2pc").options(**options).trigger(availableNow=True).start()
    )
    assert query.awaitTermination(120), "the AvailableNow query did not finish in 120 s"
    assert query.exception() is None
    (sink_dir,) = (chk / "kafka2pc").iterdir()
    store = LocalDecisionStore(sink_dir)
    for batch_id in range(3):
        decision = store.get(batch_id)
        assert decision is not None and sum(t.records for t in decision.transactions) == 200
        assert {t.partition: t.transactional_id.rsplit(".", 1)[1] for t in decision.transactions}[0] == "1"
    assert store.get(3) is None
    assert_exactly_once(kafka_bootstrap, out, expected)
    assert recover(options) == 0  # nothing left open
