"""A Spark driver process for the crash tests: one streaming query into KafkaTwoPhaseSink.

Run as ``python _spark_driver.py '<json config>'``; the test SIGKILLs its process
group (this Python process and the Spark JVM it launched) at a crash point the
test names in ``$K2PC_SPARK_TEST_CRASH`` (``crash_at``, ``crash_batch``,
``crash_marker``): the sink's ``on_step`` hook writes the marker file there and
blocks until the test kills the process group.  When the
query has finished, it writes the sink's metrics as JSON to ``metrics_path``.

Config keys: ``bootstrap``, ``out_topic``, ``checkpoint``, ``source``
(``"rate"`` or ``"files"``), ``rows_per_batch`` and ``last_batch`` (rate:
batches after ``last_batch`` write nothing, so the expected output is exact),
``files_dir`` and ``files_per_batch`` (files: JSON lines ``{"id": .., "v": ..}``
read with Trigger.AvailableNow; ``value`` = ``v``, ``key`` = ``id % 7``),
optional ``master`` (default ``local[2,4]``), ``spark_conf`` (extra Spark
settings) and ``producer_config`` (extra producer settings), ``remote`` (a Spark
Connect URL: this process is then a Connect client, and the sink runs in that
server), ``prefix`` (the transactional id prefix), ``metrics_path``,
``error_path`` (a failed query writes its error there and exits 3), ``log_path``,
``writes`` (the data source's batch job: how many times it runs the write, default 1).
No source needs Spark's Kafka connector.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import time


def crash_hook():  # type: ignore[no-untyped-def]
    """The sink's ``on_step`` hook from ``$K2PC_SPARK_TEST_CRASH``: at the named step, mark and block."""
    text = os.environ.get("K2PC_SPARK_TEST_CRASH", "").strip()
    if not text:
        return None
    faults = json.loads(text)

    def on_step(step, batch_id):  # type: ignore[no-untyped-def]
        if step.value != faults["crash_at"]:
            return
        if faults.get("crash_batch") is not None and faults["crash_batch"] != batch_id:
            return
        logging.getLogger(__name__).warning("crash point %s of batch %d", step.value, batch_id)
        marker = faults["crash_marker"]  # written whole, then renamed: the test reads it as soon as it exists
        with open(marker + ".tmp", "w") as tmp:
            tmp.write(f"{step.value} {batch_id}\n")
        os.replace(marker + ".tmp", marker)
        while True:  # the test SIGKILLs the process group (JVM included)
            time.sleep(60)

    return on_step


def task_hook(spec):  # type: ignore[no-untyped-def]
    """A task hook of ``_cluster_hooks`` from ``{"kind": "BlockAt" | "SlowAt", **fields}``, or a list of them."""
    if not spec:
        return None
    import _cluster_hooks

    if isinstance(spec, list):
        return _cluster_hooks.Chain(tuple(task_hook(one) for one in spec))
    fields = dict(spec)
    return getattr(_cluster_hooks, fields.pop("kind"))(**fields)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    logging.basicConfig(
        filename=cfg["log_path"], level=logging.INFO,
        format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s",
    )
    for noisy in ("kafka", "py4j", "pyspark"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from kafka2pc.recipes.spark import KafkaTwoPhaseSink
    from kafka2pc.recipes.spark._faults import inject_task_hook
    from pyspark.sql import SparkSession

    if cfg.get("remote"):
        spark = SparkSession.builder.remote(cfg["remote"]).create()
    else:
        builder = (
            SparkSession.builder.master(cfg.get("master", "local[2,4]"))
            .appName("kafka2pc-crash-driver")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.ui.enabled", "false")
            .config("spark.pyspark.python", sys.executable)
            .config("spark.sql.streaming.minBatchesToRetain", "20")
        )
        if cfg.get("task_hook"):  # the executors import the hook's module by name
            builder = builder.config("spark.executorEnv.PYTHONPATH", os.path.dirname(os.path.abspath(__file__)))
        for key, value in cfg.get("spark_conf", {}).items():
            builder = builder.config(key, value)
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")

    producer_config = {"bootstrap.servers": cfg["bootstrap"], **cfg.get("producer_config", {})}
    if cfg.get("sink") == "datasource":
        run_data_source(spark, cfg, producer_config)
    where = {"checkpoint_location": cfg["checkpoint"]} if cfg.get("remote") else {}  # Connect: the sink is told
    if cfg.get("prefix"):
        where["transactional_id_prefix"] = cfg["prefix"]
    sink = KafkaTwoPhaseSink(producer_config, topic=cfg["out_topic"], on_step=crash_hook(), **where)
    inject_task_hook(sink, task_hook(cfg.get("task_hook")))
    done = threading.Event()

    if cfg["source"] == "rate":
        last = int(cfg["last_batch"])

        def foreach_batch(df, batch_id):  # type: ignore[no-untyped-def]
            if batch_id <= last:
                sink(df, batch_id)
            if batch_id >= last:
                done.set()

        stream = (
            spark.readStream.format("rate-micro-batch")
            .option("rowsPerBatch", int(cfg["rows_per_batch"]))
            .option("numPartitions", 2)
            .load()
            .selectExpr("CAST(value AS STRING) AS value", "CAST(value % 10 AS STRING) AS key")
        )
        query = stream.writeStream.foreachBatch(foreach_batch).option("checkpointLocation", cfg["checkpoint"])
        running = query.start()
        if not done.wait(240):
            raise SystemExit("the query did not reach the last batch in 240s")
        running.stop()
    else:
        stream = (
            spark.readStream.schema("id long, v string")
            .option("maxFilesPerTrigger", int(cfg["files_per_batch"]))
            .json(cfg["files_dir"])
            .selectExpr("CAST(id % 7 AS STRING) AS key", "v AS value")
        )
        running = (
            stream.writeStream.foreachBatch(sink)
            .option("checkpointLocation", cfg["checkpoint"])
            .trigger(availableNow=True)
            .start()
        )
        try:
            finished = running.awaitTermination(240)
        except Exception:  # noqa: BLE001 - PySpark raises the query's failure here; reported below
            finished = True
        if not finished:
            raise SystemExit("the AvailableNow query did not finish in 240s")
        if running.exception() is not None:
            with open(cfg["error_path"], "w") as err:
                err.write(str(running.exception()))
            sink.close()
            spark.stop()
            os._exit(3)
    with open(cfg["metrics_path"], "w") as out:
        json.dump([dataclasses.asdict(m) for m in sink.metrics()], out, default=str)
    sink.close()
    spark.stop()
    os._exit(0)  # do not wait for py4j's non-daemon threads


def run_data_source(spark, cfg, producer_config):  # type: ignore[no-untyped-def]
    """format("kafka2pc"): ``source`` "files" streams (AvailableNow), "batch" writes the files in one job."""
    from kafka2pc.recipes.spark._datasource import Kafka2pcDataSource

    class Source(Kafka2pcDataSource):
        _on_step = crash_hook()
        _task_hook = task_hook(cfg.get("task_hook"))

    if not cfg.get("auto_register"):  # else PySpark finds the installed pyspark_kafka2pc module's DefaultSource
        spark.dataSource.register(Source)
    options = {f"kafka.{k}": str(v) for k, v in producer_config.items()}
    options["topic"] = cfg["out_topic"]
    if cfg.get("prefix"):
        options["kafka2pc.transactionalIdPrefix"] = cfg["prefix"]
    error = None
    if cfg["source"] == "batch":
        options.update({"kafka2pc.runId": cfg["run_id"], "kafka2pc.decisionPath": cfg["decision_path"]})
        df = spark.read.schema("id long, v string").json(cfg["files_dir"]).selectExpr(
            "CAST(id % 7 AS STRING) AS key", "v AS value")
        try:
            for _ in range(int(cfg.get("writes", 1))):  # a second write with the run id must write nothing
                df.write.format("kafka2pc").options(**options).mode("append").save()
        except Exception as exc:  # noqa: BLE001 - reported below
            error = exc
    else:
        running = (
            spark.readStream.schema("id long, v string")
            .option("maxFilesPerTrigger", int(cfg["files_per_batch"]))
            .json(cfg["files_dir"])
            .selectExpr("CAST(id % 7 AS STRING) AS key", "v AS value")
            .writeStream.format("kafka2pc").options(**options).option("checkpointLocation", cfg["checkpoint"])
            .trigger(availableNow=True).start()
        )
        try:
            if not running.awaitTermination(240):
                raise SystemExit("the AvailableNow query did not finish in 240s")
        except Exception:  # noqa: BLE001 - PySpark raises the query's failure here; reported below
            pass
        error = running.exception()
    if error is not None:
        with open(cfg["error_path"], "w") as err:
            err.write(str(error))
        spark.stop()
        os._exit(3)
    with open(cfg["metrics_path"], "w") as out:
        json.dump([], out)
    spark.stop()
    os._exit(0)


if __name__ == "__main__":
    main()
