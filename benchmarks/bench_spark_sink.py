"""Throughput and visibility latency: KafkaTwoPhaseSink vs at-least-once sinks, same input, same run.

Input: Parquet files (``--records`` rows of ``--value-bytes``-byte values, in
``--files`` files) read by a Structured Streaming query with
``Trigger.AvailableNow`` and ``maxFilesPerTrigger`` so that it runs in
``--batches`` micro-batches; every sink writes to a fresh output topic.  No
source needs Spark's Kafka connector.  ``--mode batch`` writes the same input
in one batch job per run instead (``df.write.format(...).save()``; the
``foreachBatch`` sinks are called once on the static DataFrame).

Sinks (rounds alternate between them so that they share the machine's load):

- ``plain``: an at-least-once ``foreachBatch`` writer on the same Python path
  (``mapInArrow``, one ``confluent_kafka.Producer`` per task, produce + flush,
  no transactions): what this sink costs beyond Python's per-record cost;
- ``builtin``: Spark's own Kafka sink (at-least-once), only when the connector
  ``spark-sql-kafka-0-10`` for the installed PySpark resolves (it does not for
  4.0.1+ from the Maven repository CI reaches: its token-provider dependency
  is missing); ``--baseline`` picks what the headline ratio is against;
- ``ours``: KafkaTwoPhaseSink (exactly-once, ``foreachBatch``);
- ``datasource``: ``writeStream.format("kafka2pc")`` (exactly-once, PySpark 4's
  Python data source; its rows are visible when its batch ends);
- ``floor`` (``--with-floor``): a ``foreachBatch`` that moves the columns ours
  sends (key, value, the row hash) to Python with ``mapInArrow`` and drops
  them: what any sink on PySpark's Python workers pays before writing a row.

CPU per sink run is also measured, per process group (``/proc``: the Spark
JVMs, the Python workers under them, the Kafka broker; own and reaped
children's user+system time): unlike wall time it does not depend on what
else runs on the machine, and on a CPU-bound machine it decides throughput.

Measured: rows/s (records / query wall time), per round the ratio ours/baseline
(the median of those is the headline); per batch, for ours, time to
visibility and the 2PC part after the tasks; for the others the ``addBatch``
duration (their rows are visible as soon as written).

``--connect`` measures the two exactly-once paths (``ours``, ``datasource``) on
the classic session and on a Spark Connect client of the same driver (one
JVM, which serves Connect on a loopback port), rounds interleaved: what
Connect's client/server hop costs.

Prints a table and replaces the ``## Spark sink`` section of ``benchmarks/RESULTS.md``
(``## Spark sink, batch write`` with ``--mode batch``; ``, standalone cluster (2 Workers)`` with ``--cluster``;
``## Spark sink, Spark Connect vs classic`` with ``--connect``).

    python benchmarks/bench_spark_sink.py --records 400000 --batches 2 --rounds 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import resource
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kafka2pc.recipes.spark import KafkaTwoPhaseSink

from kafka2pc.testing import create_topic, drain, end_offsets

from _results import record_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script


def write_input(spark: Any, directory: Path, records: int, files: int, value_bytes: int) -> None:
    """Parquet input: ``key`` = id % 1000, ``value`` = 12-digit id + padding (unique values)."""
    shutil.rmtree(directory, ignore_errors=True)
    pad = "x" * max(0, value_bytes - 12)
    (
        spark.range(0, records, numPartitions=files)
        .selectExpr("CAST(id % 1000 AS STRING) AS key", f"CONCAT(LPAD(CAST(id AS STRING), 12, '0'), '{pad}') AS value")
        .write.parquet(str(directory))
    )


def plain_writer(bootstrap: str, topic: str) -> Any:
    """The at-least-once baseline: a plain producer per task, produce every row, flush."""

    def write(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": bootstrap, "enable.sparse.connections": False})
        n = 0
        for batch in batches:
            names = batch.schema.names
            values = batch.column(names.index("value")).to_pylist()
            keys = batch.column(names.index("key")).to_pylist()
            for value, key in zip(values, keys, strict=True):
                while True:
                    try:
                        producer.produce(topic, value, key)
                        break
                    except BufferError:
                        producer.poll(0.05)
            producer.poll(0)
            n += len(values)
        if producer.flush(60) != 0:
            raise RuntimeError("plain baseline: records not delivered")
        yield pa.RecordBatch.from_pylist([{"n": n}])

    def foreach_batch(df: Any, batch_id: int) -> None:
        df.select("key", "value").mapInArrow(write, "n long").collect()

    return foreach_batch


def floor_writer(df: Any, batch_id: int) -> None:
    """The floor: the columns ours sends (as ours casts and hashes them) moved to Python and dropped."""
    from pyspark.sql import functions as sql

    def drop(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        n = sum(batch.num_rows for batch in batches)
        yield pa.RecordBatch.from_pylist([{"n": n}])

    hashed = sql.xxhash64("key", "value", sql.isnull("key"), sql.isnull("value"))
    df.select("key", "value", hashed.alias("h")).mapInArrow(drop, "n long").collect()


_TICK = os.sysconf("SC_CLK_TCK")
CPU_PARTS = ("spark_jvm", "python", "broker", "bench")
"""Where CPU is counted: Spark's JVMs, PySpark's Python workers, the Kafka broker, this process (the driver's Python)."""


def _processes() -> dict[int, tuple[int, bool, float]]:
    """pid -> (parent pid, is a Python process, own + reaped children's CPU seconds), from /proc."""
    table: dict[int, tuple[int, bool, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index(b"(") + 1:stat.rindex(b")")]
        fields = stat[stat.rindex(b")") + 2:].split()
        cpu = sum(int(x) for x in fields[11:15]) / _TICK  # utime, stime, cutime, cstime
        table[int(entry)] = (int(fields[1]), name.startswith(b"python"), cpu)
    return table


def cpu_snapshot(roots: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far per part: each root's process tree, Python processes in it counted as ``python``."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out = dict.fromkeys(CPU_PARTS, 0.0)
    me = os.getpid()
    for part, pids in roots.items():
        stack = [p for p in pids if p in table]
        while stack:
            pid = stack.pop()
            _, is_python, cpu = table[pid]
            out["python" if is_python and pid != me else part] += cpu
            stack.extend(c for c in children.get(pid, []) if c != me)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["bench"] = usage.ru_utime + usage.ru_stime
    return out


def run_query(spark: Any, bootstrap: str, source: Path, files_per_batch: int, out: str, sink: str,
              work: Path, cpu_roots: dict[str, list[int]] | None = None) -> dict[str, Any]:
    stream = spark.readStream.schema("key string, value string").option(
        "maxFilesPerTrigger", files_per_batch
    ).parquet(str(source))
    checkpoint = str(work / f"chk-{sink}-{uuid.uuid4().hex[:8]}")
    sink, _, where = sink.partition("@")  # "ours@connect": spark is a Spark Connect client
    ours: KafkaTwoPhaseSink | None = None
    if sink == "builtin":
        writer = (
            stream.writeStream.format("kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("topic", out)
        )
    elif sink == "plain":
        writer = stream.writeStream.foreachBatch(plain_writer(bootstrap, out))
    elif sink == "floor":
        writer = stream.writeStream.foreachBatch(floor_writer)
    elif sink == "datasource":
        writer = (
            stream.writeStream.format("kafka2pc")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("topic", out)
        )
    else:
        # On Spark Connect the sink is told its checkpoint (docs/spark-connect.md)
        ours = KafkaTwoPhaseSink({"bootstrap.servers": bootstrap}, topic=out,
                                 checkpoint_location=checkpoint if where == "connect" else None)
        writer = stream.writeStream.foreachBatch(ours)
    cpu_before = cpu_snapshot(cpu_roots or {})
    started = time.monotonic()
    query = writer.option("checkpointLocation", checkpoint).trigger(availableNow=True).start()
    query.awaitTermination(900)
    elapsed = time.monotonic() - started
    cpu_after = cpu_snapshot(cpu_roots or {})
    if query.exception() is not None:
        raise RuntimeError(f"{sink}: {query.exception()}")
    progress = [p for p in query.recentProgress if (_progress(p, "numInputRows") or 0) > 0]
    result: dict[str, Any] = {
        "elapsed": elapsed,
        "rows": sum(_progress(p, "numInputRows") for p in progress),
        "batches": len(progress),
        "add_batch_s": [_progress(p, "durationMs").get("addBatch", 0) / 1000 for p in progress],
        "cpu": {part: cpu_after[part] - cpu_before[part] for part in CPU_PARTS},
    }
    if ours is not None:
        result.update(sink_metrics(ours))
        ours.close()
    return result


def _progress(progress: Any, name: str) -> Any:
    """A field of a query's progress: an attribute on PySpark 4 (on Connect the dict's numInputRows is None),
    a key of the dict on 3.5."""
    value = getattr(progress, name, None)
    return value if value is not None else progress.get(name)


def sink_metrics(ours: KafkaTwoPhaseSink) -> dict[str, Any]:
    """Per batch of ``ours``: time to visibility and where it went (the sink's own metrics)."""
    ms = ours.metrics()
    return {
        "ttv_s": [m.time_to_visibility_s for m in ms],
        "commit_s": [m.commit_latency_s for m in ms],
        "decision_s": [m.decision_s for m in ms],
        "completion_s": [m.completion_s for m in ms],
        "write_s": [m.write_s for m in ms],
        "tasks": [(round(m.task_open_s, 3), round(m.task_write_s, 3), round(m.task_prepare_s, 3)) for m in ms],
        "settle_s": [m.settle_s for m in ms],
        "job_rest_s": [m.write_s - m.task_open_s - m.task_write_s - m.task_prepare_s for m in ms],
        "commit_only_s": [m.commit_latency_s - m.decision_s for m in ms],
        "sweep_s": [m.completion_s - (m.commit_latency_s - m.decision_s) for m in ms],
        "driver_rest_s": [m.time_to_visibility_s - m.settle_s - m.write_s - m.commit_latency_s for m in ms],
    }


def run_batch(spark: Any, bootstrap: str, source: Path, records: int, out: str, sink: str, work: Path,
              cpu_roots: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """One batch job (``df.write``) writing the whole input (``records`` rows): visible when the job returns.

    ``builtin`` is ``df.write.format("kafka")``, ``datasource`` ``df.write.format("kafka2pc")``
    with a fresh run id; ``ours``, ``plain`` and ``floor`` are their ``foreachBatch``
    callables called once on the static DataFrame (batch id 0; ours with its own
    ``checkpoint_location``, as a batch job has no query checkpoint).
    """
    df = spark.read.schema("key string, value string").parquet(str(source))
    ours: KafkaTwoPhaseSink | None = None
    cpu_before = cpu_snapshot(cpu_roots or {})
    started = time.monotonic()
    if sink == "builtin":
        df.write.format("kafka").option("kafka.bootstrap.servers", bootstrap).option("topic", out).save()
    elif sink == "plain":
        plain_writer(bootstrap, out)(df, 0)
    elif sink == "floor":
        floor_writer(df, 0)
    elif sink == "datasource":
        (
            df.write.format("kafka2pc").option("kafka.bootstrap.servers", bootstrap).option("topic", out)
            .option("kafka2pc.runId", uuid.uuid4().hex).option("kafka2pc.decisionPath", str(work / "decisions"))
            .mode("append").save()
        )
    else:
        ours = KafkaTwoPhaseSink({"bootstrap.servers": bootstrap}, topic=out,
                                 checkpoint_location=str(work / f"chk-ours-{uuid.uuid4().hex[:8]}"))
        ours(df, 0)
    elapsed = time.monotonic() - started
    cpu_after = cpu_snapshot(cpu_roots or {})
    result: dict[str, Any] = {
        "elapsed": elapsed, "rows": records, "batches": 1, "add_batch_s": [elapsed],
        "cpu": {part: cpu_after[part] - cpu_before[part] for part in CPU_PARTS},
    }
    if ours is not None:
        result.update(sink_metrics(ours))
        ours.close()
    return result


def start_spark(master: str, package: str | None, connect_port: int | None = None) -> Any:
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    if connect_port is not None:  # the same driver also serves Spark Connect (PySpark 4's spark-connect jar)
        builder = (
            builder.config("spark.plugins", "org.apache.spark.sql.connect.SparkConnectPlugin")
            .config("spark.connect.grpc.binding.address", "127.0.0.1")
            .config("spark.connect.grpc.binding.port", str(connect_port))
        )
    if master.startswith("spark://"):  # the standalone cluster of --cluster: two Workers, 2 cores each
        builder = (
            builder.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.executor.memory", "512m").config("spark.executor.cores", "2")
            .config("spark.cores.max", "4").config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        )
    builder = (
        builder.master(master)
        .appName("kafka2pc-bench-spark-sink")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.pyspark.python", sys.executable)
    )
    if package is not None:
        builder = builder.config("spark.jars.packages", package)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"),
                        help="bootstrap servers (default: start or reuse the local broker)")
    parser.add_argument("--records", type=int, default=400_000)
    parser.add_argument("--batches", type=int, default=2, help="micro-batches per query (--mode stream)")
    parser.add_argument("--mode", choices=["stream", "batch"], default="stream",
                        help="stream: a Trigger.AvailableNow query per run; batch: one df.write job per run")
    parser.add_argument("--files", type=int, default=8, help="input files (a multiple of --batches)")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--cluster", action="store_true",
                        help="start a standalone cluster (Master + Workers on 127.0.0.1 and 127.0.0.2, from "
                             "tests/spark/_standalone.py) and run on it instead of --master")
    parser.add_argument("--baseline", choices=["plain", "builtin"], default="plain",
                        help="what the headline ratio is against (builtin needs Spark's Kafka connector)")
    parser.add_argument("--with-builtin", action="store_true",
                        help="also measure Spark's built-in Kafka sink if its connector resolves")
    parser.add_argument("--with-floor", action="store_true",
                        help="also measure the floor: the rows moved to Python workers and dropped")
    parser.add_argument("--partitions", type=int, default=2, help="source and output topic partitions")
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work", default="/tmp/kafka2pc-bench-spark")
    parser.add_argument("--connect", action="store_true",
                        help="the exactly-once paths on a classic session and on a Spark Connect client of it")
    parser.add_argument("--no-append", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    args.broker_pids = []
    if args.bootstrap is None:
        from kafka2pc.testing.broker import LocalKafka

        kafka = LocalKafka.up()
        args.bootstrap = kafka.bootstrap_servers
        args.broker_pids = [n.pid for n in kafka.nodes if n.pid]

    cluster = None
    if args.cluster:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "spark"))
        from _standalone import start_cluster

        cluster = start_cluster(Path(args.work) / "cluster")
        args.master = cluster.master_url
    args.cluster_pids = [proc.pid for proc in cluster.procs] if cluster is not None else []
    try:
        run_connect(args) if args.connect else run(args)
    finally:
        if cluster is not None:
            cluster.stop()


def run(args: argparse.Namespace) -> None:
    import pyspark

    os.environ["PYSPARK_PYTHON"] = sys.executable
    scala = "2.12" if pyspark.__version__.startswith("3.") else "2.13"  # the pyspark wheels' Scala
    package = os.environ.get(
        "KAFKA2PC_SPARK_KAFKA_PACKAGE", f"org.apache.spark:spark-sql-kafka-0-10_{scala}:{pyspark.__version__}"
    )
    sinks = ["plain", "ours"]
    note = ""
    if args.baseline == "builtin" or args.with_builtin:
        try:
            spark = start_spark(args.master, package)
            sinks.insert(0, "builtin")
        except Exception as exc:  # noqa: BLE001 - the connector does not resolve: say so, measure the rest
            note = (f"Spark's Kafka connector {package} did not resolve ({type(exc).__name__}); "
                    "built-in sink not measured")
            print(note, file=sys.stderr)
            from pyspark.sql import SparkSession

            active = SparkSession.getActiveSession()
            if active is not None:
                active.stop()
            spark = start_spark(args.master, None)
    else:
        spark = start_spark(args.master, None)
    if args.with_floor:
        sinks.insert(0, "floor")
    if int(pyspark.__version__.split(".")[0]) >= 4:
        from kafka2pc.recipes.spark import register_data_source

        register_data_source(spark)
        sinks.append("datasource")
    baseline = args.baseline if args.baseline in sinks else "plain"
    cpu_roots = {"spark_jvm": [spark.sparkContext._gateway.proc.pid, *args.cluster_pids],
                 "broker": args.broker_pids}
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    source = work / "input"
    write_input(spark, source, args.records, args.files, args.value_bytes)
    files_per_batch = -(-args.files // args.batches)
    if args.mode == "batch":
        args.batches = 1

    def measure(out: str, sink: str) -> dict[str, Any]:
        if args.mode == "batch":
            return run_batch(spark, args.bootstrap, source, args.records, out, sink, work, cpu_roots)
        return run_query(spark, args.bootstrap, source, files_per_batch, out, sink, work, cpu_roots)

    # Warm-up (JIT, Python workers, connector classes), not measured.
    warm = create_topic(args.bootstrap, partitions=args.partitions)
    for sink in sinks:
        measure(warm, sink)

    runs: dict[str, list[dict[str, Any]]] = {sink: [] for sink in sinks}
    for round_ in range(args.rounds):
        order = sinks if round_ % 2 == 0 else list(reversed(sinks))
        for sink in order:
            out = create_topic(args.bootstrap, partitions=args.partitions)
            result = measure(out, sink)
            assert result["rows"] == args.records, result
            if sink in ("ours", "datasource"):  # check exactly-once (outside the timed part)
                seen = [r.value for r in drain(args.bootstrap, out, "read_committed", timeout=120)]
                assert len(seen) == len(set(seen)) == args.records, ("not exactly once", len(seen))
                assert end_offsets(args.bootstrap, out, "read_committed") == end_offsets(args.bootstrap, out)
            runs[sink].append(result)
    spark.stop()

    med = statistics.median
    rates = {sink: [args.records / r["elapsed"] for r in rs] for sink, rs in runs.items()}

    def per_batch(sink: str, key: str, *, skip_first: bool = False) -> list[float]:
        """``key`` of every batch of every round (without each query's first batch with ``skip_first``)."""
        return [x for r in runs[sink] for x in r[key][1 if skip_first else 0:]]

    labels = {
        "builtin": "Spark built-in Kafka sink (at-least-once)",
        "plain": "plain confluent-kafka foreachBatch (at-least-once, same Python path)",
        "ours": "KafkaTwoPhaseSink (exactly-once)",
        "floor": "floor: rows moved to Python and dropped (no sink)",
        "datasource": 'format("kafka2pc") data source (exactly-once)',
    }
    ours_ttv = med(per_batch("ours", "ttv_s"))
    ours_commit = med(per_batch("ours", "commit_s"))
    tasks = [t for r in runs["ours"] for t in r["tasks"]]
    lines = [
        (
            f"mode={args.mode} records={args.records} batches={args.batches} files={args.files} partitions={args.partitions} "
            f"value={args.value_bytes}B rounds={args.rounds} pyspark={pyspark.__version__} "
            f"master={args.master} cores={os.cpu_count()} load={os.getloadavg()[0]:.1f}"
            + (f" builtin-connector={package}" if "builtin" in sinks else "")
        ),
        "",
        "| sink | rows/s (median of rounds) | rows/s (best round) | batch s | visible after s | 2PC commit s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for sink in sinks:
        batch_s = med(per_batch(sink, "add_batch_s"))
        visible = ours_ttv if sink == "ours" else batch_s
        commit = f"{ours_commit:.3f}" if sink == "ours" else "-"
        lines.append(f"| {labels[sink]} | {med(rates[sink]):,.0f} | {max(rates[sink]):,.0f} | {batch_s:.3f} | "
                     f"{visible:.3f} | {commit} |")
    lines += [
        "",
        (
            "(batch, visible-after and commit columns: medians over every batch of every round; an at-least-once "
            "sink's rows are visible when its batch ends, ours when the last transaction commits)"
        ),
        "",
    ]
    per_100k = 100_000 / args.records
    lines += [
        "CPU per 100k rows (median of rounds; user+system seconds of each process group during the query, "
        "so independent of the machine's other load):",
        "",
        "| sink | Spark JVMs | Python workers | Kafka broker | driver's Python | total | total vs "
        f"{baseline} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base_total = med(sum(r["cpu"].values()) for r in runs[baseline]) * per_100k
    for sink in sinks:
        parts = [med(r["cpu"][part] for r in runs[sink]) * per_100k for part in CPU_PARTS]
        total = med(sum(r["cpu"].values()) for r in runs[sink]) * per_100k
        lines.append(f"| {labels[sink]} | " + " | ".join(f"{x:.3f}" for x in parts)
                     + f" | {total:.3f} | {total / base_total:.2f}x |")
    lines.append("")
    for base in [b for b in ("builtin", "plain") if b in sinks]:
        ratios = [o / b for b, o in zip(rates[base], rates["ours"], strict=True)]
        base_batch = med(per_batch(base, "add_batch_s"))
        strong = "**" if base == baseline else ""
        steady = ""
        if args.batches > 1:  # a running query's batches: its first one also settles what an earlier run left
            later = (med(per_batch("ours", "ttv_s", skip_first=True))
                     - med(per_batch(base, "add_batch_s", skip_first=True)))
            steady = f", {later:+.3f}s after each query's first batch"
        lines += [
            (
                f"throughput ratio ours/{base}: {strong}{med(ratios):.2f}x{strong} median of per-round ratios "
                f"(min {min(ratios):.2f}, max {max(ratios):.2f}); added latency to visibility per batch "
                f"{ours_ttv - base_batch:+.3f}s (median of every batch){steady}"
            ),
            "",
        ]
    if "datasource" in sinks:
        for base in [b for b in ("builtin", "plain", "ours") if b in sinks]:
            ratios = [d / b for b, d in zip(rates[base], rates["datasource"], strict=True)]
            added = med(per_batch("datasource", "add_batch_s")) - med(per_batch(base, "add_batch_s"))
            if base == "ours":
                added = med(per_batch("datasource", "add_batch_s")) - ours_ttv
            lines += [
                (
                    f"throughput ratio datasource/{base}: **{med(ratios):.2f}x** median of per-round ratios "
                    f"(min {min(ratios):.2f}, max {max(ratios):.2f}); added latency to visibility per batch "
                    f"{added:+.3f}s (median of every batch)"
                ),
                "",
            ]
    ttv_rows = [
        ("before the job: settle leftovers (first batch), check the topic", med(per_batch("ours", "settle_s"))),
        ("write job, slowest task: open (producer + init_transactions, fences older attempts)",
         med(t[0] for t in tasks)),
        ("write job, slowest task: produce the rows (pulling them from the JVM included)",
         med(t[1] for t in tasks)),
        ("write job, slowest task: prepare (flush; the anchor asked of the partition leader)",
         med(t[2] for t in tasks)),
        ("write job, the rest (Spark scheduling, reading the input, Arrow to Python, results)",
         med(per_batch("ours", "job_rest_s"))),
        ("decision file (the commit point)", med(per_batch("ours", "decision_s"))),
        ("commit through the coordinator (EndTxn, markers)", med(per_batch("ours", "commit_only_s"))),
        ("other driver work (replay check, metrics)", med(per_batch("ours", "driver_rest_s"))),
        ("**call of the sink to visible** (time to visibility)", ours_ttv),
        ("sweep for stray transactions (after visibility unless it aborted one)",
         med(per_batch("ours", "sweep_s"))),
    ]
    if "builtin" in sinks:
        ttv_rows.append(("Spark's built-in sink, batch (its rows are visible then)", med(per_batch("builtin", "add_batch_s"))))
    lines += ["", "Where the time of one batch goes (ours; medians over every batch of every round, so the parts do "
              "not add up exactly):", "", "| part | s |", "|---|---:|"]
    lines += [f"| {label} | {value:.3f} |" for label, value in ttv_rows]
    lines += [
        "",
        (
            f"ours, per batch (medians): decision file {med(per_batch('ours', 'decision_s')):.3f}s, completion "
            f"through the coordinator {med(per_batch('ours', 'completion_s')):.3f}s with the stray sweep (2PC "
            "after the tasks, to visibility: "
            f"{ours_commit:.3f}s); slowest task: open (init_transactions) {med(t[0] for t in tasks):.3f}s, "
            f"write {med(t[1] for t in tasks):.3f}s, prepare {med(t[2] for t in tasks):.3f}s"
        ),
        "",
        "rows/s per round: " + ", ".join(f"{sink} {[round(x) for x in rates[sink]]}" for sink in sinks),
    ]
    if note:
        lines += ["", note]
    text = "\n".join(lines)
    print(text)
    if not args.no_append:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        line = ".".join(pyspark.__version__.split(".")[:2])
        heading = "Spark sink" if int(line.split(".")[0]) >= 4 else f"Spark sink on PySpark {line}"
        if args.mode == "batch":
            heading += ", batch write"
        if args.master.startswith("spark://"):
            heading += ", standalone cluster (2 Workers)"
        command = " ".join(["benchmarks/bench_spark_sink.py", *sys.argv[1:]])
        record_section(heading, f"`{command}`, {stamp}\n\n{text}")


def run_connect(args: argparse.Namespace) -> None:
    """``--connect``: ours and the data source, classic and Spark Connect, rounds interleaved."""
    import pyspark
    from kafka2pc.recipes.spark import register_data_source
    from pyspark.sql import SparkSession

    from kafka2pc.testing.broker import port_base

    os.environ["PYSPARK_PYTHON"] = sys.executable
    port = port_base() + 1800  # tests/harness/ports.py: the Spark Connect port of the block
    classic = start_spark(args.master, None, connect_port=port)
    remote = SparkSession.builder.remote(f"sc://127.0.0.1:{port}").create()
    os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)  # set per call below: PySpark reads it per process
    sessions = {"classic": classic, "connect": remote}

    def on(where: str) -> Any:
        if where == "connect":
            os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
        else:
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
        return sessions[where]

    for where in sessions:
        register_data_source(on(where))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    source = work / "input"
    write_input(on("classic"), source, args.records, args.files, args.value_bytes)
    files_per_batch = -(-args.files // args.batches)
    sinks = ["ours@classic", "ours@connect", "datasource@classic", "datasource@connect"]
    warm = create_topic(args.bootstrap, partitions=args.partitions)
    for sink in sinks:
        run_query(on(sink.split("@")[1]), args.bootstrap, source, files_per_batch, warm, sink, work)
    runs: dict[str, list[dict[str, Any]]] = {sink: [] for sink in sinks}
    for round_ in range(args.rounds):
        for sink in sinks if round_ % 2 == 0 else list(reversed(sinks)):
            out = create_topic(args.bootstrap, partitions=args.partitions)
            result = run_query(on(sink.split("@")[1]), args.bootstrap, source, files_per_batch, out, sink, work)
            seen = [r.value for r in drain(args.bootstrap, out, "read_committed", timeout=120)]
            assert result["rows"] == len(seen) == len(set(seen)) == args.records, ("not exactly once", len(seen))
            runs[sink].append(result)
    remote.stop()
    on("classic").stop()
    med = statistics.median
    rates = {sink: [args.records / r["elapsed"] for r in rs] for sink, rs in runs.items()}
    lines = [
        f"records={args.records} batches={args.batches} files={args.files} partitions={args.partitions} "
        f"value={args.value_bytes}B rounds={args.rounds} pyspark={pyspark.__version__} master={args.master} "
        f"cores={os.cpu_count()} load={os.getloadavg()[0]:.1f} (a shared machine: compare the interleaved ratios)",
        "",
        "| path | session | rows/s (median of rounds) | rows/s (best round) | batch s (median) |",
        "|---|---|---:|---:|---:|",
    ]
    for sink in sinks:
        kind, where = sink.split("@")
        batch_s = med(x for r in runs[sink] for x in r["add_batch_s"])
        lines.append(f"| {kind} | {where} | {med(rates[sink]):,.0f} | {max(rates[sink]):,.0f} | {batch_s:.3f} |")
    lines.append("")
    for kind in ("ours", "datasource"):
        ratios = [c / k for k, c in zip(rates[f"{kind}@classic"], rates[f"{kind}@connect"], strict=True)]
        lines.append(f"throughput ratio {kind} connect/classic: **{med(ratios):.2f}x** median of per-round ratios "
                     f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
    lines += ["", "rows/s per round: " + ", ".join(f"{s} {[round(x) for x in rates[s]]}" for s in sinks)]
    text = "\n".join(lines)
    print(text)
    if not args.no_append:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        command = " ".join(["benchmarks/bench_spark_sink.py", *sys.argv[1:]])
        record_section("Spark sink, Spark Connect vs classic", f"`{command}`, {stamp}\n\n{text}")


if __name__ == "__main__":
    main()
