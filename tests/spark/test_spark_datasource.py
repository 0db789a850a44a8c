"""format("kafka2pc") in the shared local SparkSession: batch reruns, task retries, columns, bad input, streaming.

Every test writes through a real broker and checks with a read_committed
consumer that each input row is visible exactly once and that no transaction
is left open (last stable offset == high watermark).  PySpark 4 only
(tests/spark/conftest.py leaves this module out of runs that target an older line).
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _sparkkit import assert_exactly_once, hanging, write_json_files
from kafka2pc.recipes.spark import LocalDecisionStore, SinkRecovery, SinkStep, recover, register_data_source
from kafka2pc.recipes.spark._datasource import Kafka2pcDataSource
from kafka2pc.recipes.spark._faults import FaultInjection
from pyspark.errors import AnalysisException, PythonException

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
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """The rerun writes nothing, and says so in the driver's ``logging`` (test_relay.py: not also on stderr)."""
    monitor = register_data_source(spark)
    out = topic_factory(partitions=2)
    df = spark.range(0, 500, numPartitions=3).selectExpr("CAST(id AS STRING) AS value", "CAST(id % 5 AS STRING) AS key")
    run = {"kafka2pc.runId": f"run-{uuid.uuid4().hex[:6]}", "kafka2pc.decisionPath": str(tmp_path / "d")}
    batch_write(df, kafka_bootstrap, out, **run)
    assert_exactly_once(kafka_bootstrap, out, values(500))
    (sink_dir,) = (tmp_path / "d").iterdir()
    assert sink_dir.name.startswith("r") and len(sink_dir.name) == 17  # one folder per run: r + 16 hex digits
    decision = LocalDecisionStore(sink_dir).get(0)
    assert decision is not None and len(decision.transactions) == 3 and decision.revision == 0
    assert abs(decision.created_s - time.time()) < 600
    batch = monitor.last_batch_metrics  # reported by the driver's commit worker, before save() returned
    assert batch is not None and (batch.sink_id, batch.batch_id, batch.records) == (sink_dir.name, 0, 500)
    assert (batch.replayed, batch.partitions, batch.transactions_prepared, batch.transactions_committed) == (
        False, 3, 3, 3)

    with caplog.at_level(logging.INFO, logger="kafka2pc"):
        batch_write(df, kafka_bootstrap, out, **run)  # the rerun: nothing written, nothing prepared
    (line,) = [r for r in caplog.records if "was committed already" in r.getMessage()]
    assert (line.name, line.levelname) == ("kafka2pc.recipes.spark_sink", "WARNING")
    assert line.getMessage().startswith(f"run {run['kafka2pc.runId']} was committed already (500 records in 3 ")
    assert_exactly_once(kafka_bootstrap, out, values(500))
    assert len(drain(kafka_bootstrap, out, "read_uncommitted")) == 500
    assert sorted(p.name for p in sink_dir.iterdir()) == ["0000000000000000000.000000.json"]  # zero-padded

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
    three = spark.range(3).selectExpr("CAST(id AS STRING) AS value")
    # (case, input, topic option, options, the error's own line, its bound in seconds, what PySpark wraps it
    # in: the writer's checks in an AnalysisException [PYTHON_DATA_SOURCE_ERROR], a task's error in a
    # PythonException; captured from the JVM on a classic session, from the server on Connect, with the same
    # base classes). Measured on a loaded 2-core machine: 0.1-0.5 s for the writer's checks before any task (a metadata request), 6-8 s for a
    # failing task (four attempts, local[2,4], then the driver's two sweeps for prepared transactions, 3 s
    # apart), 0.05 s for a refused bootstrap. The bounds leave room for a busier machine.
    cases: list[tuple[str, DataFrame, str | None, dict[str, str], str, float, type[Exception]]] = [
        ("no value column", spark.range(3).selectExpr("CAST(id AS STRING) AS key"), t1, {},
         r"UsageError: required attribute 'value' not found", 10, AnalysisException),
        ("no topic", three, None, {}, r"UsageError: topic option required when no 'topic' attribute is present", 10,
         AnalysisException),
        ("missing topic option", three, missing, {},
         rf"UnknownTopicError: topic '{missing}' \(the topic option\) does not exist", 10, AnalysisException),
        ("null topic", spark.range(0, 90, numPartitions=3).selectExpr(
            f"IF(id = 80, NULL, '{t1}') AS topic", "CAST(id AS STRING) AS value"), None, {},
         r"UsageError: row \d+ has a null topic and no topic option is set", 30, PythonException),
        ("missing topic in a row", spark.range(0, 90, numPartitions=3).selectExpr(
            f"IF(id = 80, '{missing}', '{t1}') AS topic", "CAST(id AS STRING) AS value"), None, {},
         rf"UnknownTopicError: topic '{missing}' does not exist \(batch 0\)", 30, PythonException),
        # No broker listens on port 9: the writer's bootstrap check fails before any Kafka request
        # (the control plane alone retried for 30 s), naming the address and the cause.
        ("refused bootstrap", three, t1, {"kafka.bootstrap.servers": "127.0.0.1:9"},
         r"BrokerUnavailableError: Kafka unreachable: 127\.0\.0\.1:9: connection refused", 5, AnalysisException),
    ]
    before = {t: len(drain(kafka_bootstrap, t, "read_committed")) for t in (t1, t2)}
    for name, bad, topic, extra, error, bound_s, wrapper in cases:
        started = time.monotonic()
        with pytest.raises(wrapper, match=error):
            batch_write(bad, extra.get("kafka.bootstrap.servers", kafka_bootstrap), topic, **dict(opts, **extra))
        elapsed = time.monotonic() - started
        assert elapsed < bound_s, f"{name}: took {elapsed:.1f}s to fail (bound {bound_s:g}s)"
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
    assert recover(options) == SinkRecovery()  # nothing left open


def test_a_batch_write_without_a_decision_path_needs_a_local_session_registered_by_the_call(
    spark: SparkSession, kafka2pc_format: Any, kafka_bootstrap: str, topic_factory: Callable[..., str],
) -> None:
    """A source registered without register_data_source cannot tell a local[*] session: it refuses the default."""
    out = topic_factory(partitions=1)
    kafka2pc_format(Kafka2pcDataSource)  # as PySpark's own lookup of pyspark_kafka2pc registers it
    with pytest.raises(Exception, match=r"UsageError: set the option kafka2pc.decisionPath for a batch write"):
        batch_write(spark.range(3).selectExpr("CAST(id AS STRING) AS value"), kafka_bootstrap, out)
    assert len(drain(kafka_bootstrap, out, "read_uncommitted")) == 0


def test_a_thread_that_registers_writes(
    spark: SparkSession, kafka2pc_format: Any, kafka_bootstrap: str, topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:
    """PySpark looks data sources up through the thread's JVM active session: register_data_source sets it."""
    out = topic_factory(partitions=2)
    errors: list[BaseException] = []

    def write(start: int) -> None:
        try:
            register_data_source(spark)
            batch_write(spark.range(start, start + 100, numPartitions=2).selectExpr("CAST(id AS STRING) AS value"),
                        kafka_bootstrap, out, **{"kafka2pc.decisionPath": str(tmp_path / "d")})
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(start,)) for start in (0, 100)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert_exactly_once(kafka_bootstrap, out, values(200))


@pytest.mark.spark_modes("connect")
def test_on_connect_a_thread_that_did_not_register_writes(
    spark: SparkSession, kafka2pc_format: Any, kafka_bootstrap: str, topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:
    """On Spark Connect the registration is the server-side session's: a client thread needs no call of its own."""
    out = topic_factory(partitions=2)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            batch_write(spark.range(0, 100, numPartitions=2).selectExpr("CAST(id AS STRING) AS value"),
                        kafka_bootstrap, out, **{"kafka2pc.decisionPath": str(tmp_path / "d")})
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    thread.join(120)
    assert not errors, errors
    assert_exactly_once(kafka_bootstrap, out, values(100))


def test_the_datasource_module_path_is_deprecated() -> None:
    sys.modules.pop("kafka2pc.recipes.spark.datasource", None)
    with pytest.warns(DeprecationWarning, match="import register_data_source and recover from kafka2pc.recipes.spark"):
        old = importlib.import_module("kafka2pc.recipes.spark.datasource")
    assert old.recover is recover and old.Kafka2pcDataSource is Kafka2pcDataSource
