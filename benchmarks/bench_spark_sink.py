"""Throughput and visibility latency: KafkaTwoPhaseSink vs Spark's built-in (at-least-once) Kafka sink.

Both sinks read the same input in the same run: a Kafka topic filled with
``--records`` records, consumed by a Structured Streaming query with
``Trigger.AvailableNow`` in ``--batches`` micro-batches, and written to a fresh
output topic.  Rounds alternate between the sinks (built-in, ours, built-in,
ours, ...) so that both see the same machine load; the best round of each
counts (the usual way to filter out noise from other processes).

Measured:

- rows/s: records divided by the query's wall time (start to termination),
  and the ratio ours/built-in per round (its median is the headline);
- per batch, for ours: time to visibility (call of the sink -> last commit)
  and the part the 2PC adds after the tasks finished (decision + completion);
  for the built-in sink: the ``addBatch`` duration (its records are visible
  to readers as soon as they are written, since it is not transactional).

Prints a table and appends it under a ``## Spark sink`` heading to
``benchmarks/RESULTS.md``.  Needs a broker (``python -m kafka2pc.testing.broker
up``) and the Spark Kafka connector from Maven Central.

    python benchmarks/bench_spark_sink.py --records 400000 --batches 4 --rounds 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from kafka2pc.recipes.spark_sink import KafkaTwoPhaseSink

from kafka2pc.testing import create_topic, drain, end_offsets

from _results import record_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script


def fill_source(bootstrap: str, topic: str, records: int, value_bytes: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 1_000_000})
    pad = b"x" * max(0, value_bytes - 12)
    for i in range(records):
        while True:
            try:
                producer.produce(topic, key=str(i % 1000).encode(), value=b"%012d" % i + pad)
                break
            except BufferError:
                producer.poll(0.05)
        if i % 50_000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0


def run_query(spark: Any, bootstrap: str, source: str, out: str, per_batch: int, sink: str,
              work: Path) -> dict[str, Any]:
    stream = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", source)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", per_batch)
        .load()
        .selectExpr("key", "value")
    )
    checkpoint = str(work / f"chk-{sink}-{uuid.uuid4().hex[:8]}")
    ours: KafkaTwoPhaseSink | None = None
    if sink == "builtin":
        writer = (
            stream.writeStream.format("kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("topic", out)
        )
    else:
        ours = KafkaTwoPhaseSink({"bootstrap.servers": bootstrap}, topic=out)
        writer = stream.writeStream.foreachBatch(ours)
    started = time.monotonic()
    query = writer.option("checkpointLocation", checkpoint).trigger(availableNow=True).start()
    query.awaitTermination(900)
    elapsed = time.monotonic() - started
    if query.exception() is not None:
        raise RuntimeError(f"{sink}: {query.exception()}")
    progress = [p for p in query.recentProgress if p.get("numInputRows", 0) > 0]
    result: dict[str, Any] = {
        "elapsed": elapsed,
        "rows": sum(p["numInputRows"] for p in progress),
        "batches": len(progress),
        "add_batch_s": [p["durationMs"].get("addBatch", 0) / 1000 for p in progress],
    }
    if ours is not None:
        result["ttv_s"] = [m.time_to_visibility_s for m in ours.metrics]
        result["commit_s"] = [m.commit_latency_s for m in ours.metrics]
        result["write_s"] = [m.write_s for m in ours.metrics]
        result["tasks"] = [(round(m.task_open_s, 3), round(m.task_write_s, 3), round(m.task_prepare_s, 3))
                           for m in ours.metrics]
        ours.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:20092"))
    parser.add_argument("--records", type=int, default=400_000)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--partitions", type=int, default=2, help="source and output topic partitions")
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", default="/tmp/kafka2pc-bench-spark")
    parser.add_argument("--no-append", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import pyspark
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    package = os.environ.get(
        "KAFKA2PC_SPARK_KAFKA_PACKAGE", f"org.apache.spark:spark-sql-kafka-0-10_2.13:{pyspark.__version__}"
    )
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("kafka2pc-bench-spark-sink")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.jars.packages", package)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    source = create_topic(args.bootstrap, partitions=args.partitions)
    fill_source(args.bootstrap, source, args.records, args.value_bytes)
    rows_per_batch = -(-args.records // args.batches)

    # Warm-up (JIT, Python workers, connector classes), not measured.
    warm = create_topic(args.bootstrap, partitions=args.partitions)
    for sink in ("builtin", "ours"):
        run_query(spark, args.bootstrap, source, warm, rows_per_batch, sink, work)

    runs: dict[str, list[dict[str, Any]]] = {"builtin": [], "ours": []}
    for _ in range(args.rounds):
        for sink in ("builtin", "ours"):
            out = create_topic(args.bootstrap, partitions=args.partitions)
            result = run_query(spark, args.bootstrap, source, out, rows_per_batch, sink, work)
            assert result["rows"] == args.records, result
            if sink == "ours":  # check exactly-once (outside the timed part)
                seen = [r.value for r in drain(args.bootstrap, out, "read_committed", timeout=120)]
                assert len(seen) == len(set(seen)) == args.records, ("not exactly once", len(seen))
                assert end_offsets(args.bootstrap, out, "read_committed") == end_offsets(args.bootstrap, out)
            runs[sink].append(result)
    spark.stop()

    med = statistics.median
    rates = {sink: [args.records / r["elapsed"] for r in rs] for sink, rs in runs.items()}
    round_ratios = [o / b for b, o in zip(rates["builtin"], rates["ours"])]

    def per_batch(sink: str, key: str) -> list[float]:
        return [x for r in runs[sink] for x in r[key]]

    builtin_batch = med(per_batch("builtin", "add_batch_s"))
    ours_batch = med(per_batch("ours", "add_batch_s"))
    ours_ttv = med(per_batch("ours", "ttv_s"))
    ours_commit = med(per_batch("ours", "commit_s"))
    tasks = [t for r in runs["ours"] for t in r["tasks"]]
    lines = [
        (
            f"records={args.records} batches={args.batches} partitions={args.partitions} "
            f"value={args.value_bytes}B rounds={args.rounds} pyspark={pyspark.__version__} "
            f"master=local[2] cores={os.cpu_count()} load={os.getloadavg()[0]:.1f}"
        ),
        "",
        "| sink | rows/s (median of rounds) | rows/s (best round) | batch s | visible after s | 2PC commit s |",
        "|---|---:|---:|---:|---:|---:|",
        (
            f"| Spark built-in Kafka sink (at-least-once) | {med(rates['builtin']):,.0f} | "
            f"{max(rates['builtin']):,.0f} | {builtin_batch:.3f} | {builtin_batch:.3f} | - |"
        ),
        (
            f"| KafkaTwoPhaseSink (exactly-once) | {med(rates['ours']):,.0f} | {max(rates['ours']):,.0f} | "
            f"{ours_batch:.3f} | {ours_ttv:.3f} | {ours_commit:.3f} |"
        ),
        "",
        (
            "(batch, visible-after and commit columns: medians over every batch of every round; the built-in "
            "sink's rows are visible when its batch ends, ours when the last transaction commits)"
        ),
        "",
        (
            f"throughput ratio ours/built-in: **{med(round_ratios):.2f}x** median of per-round ratios "
            f"(min {min(round_ratios):.2f}, max {max(round_ratios):.2f}; best round vs best round "
            f"{max(rates['ours']) / max(rates['builtin']):.2f}x; goal >= 0.8x)"
        ),
        "",
        (
            f"added latency to visibility per batch: {ours_ttv - builtin_batch:+.3f}s (median), of which the "
            f"2PC commit after the tasks (decision + completion) is {ours_commit:.3f}s"
        ),
        "",
        (
            f"our tasks, slowest per batch, median: open {med(t[0] for t in tasks):.3f}s, write "
            f"{med(t[1] for t in tasks):.3f}s, prepare {med(t[2] for t in tasks):.3f}s"
        ),
        "",
        (
            f"rows/s per round: built-in {[round(x) for x in rates['builtin']]}, "
            f"ours {[round(x) for x in rates['ours']]}"
        ),
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_append:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        record_section("Spark sink", f"`benchmarks/bench_spark_sink.py`, {stamp}\n\n{text}")


if __name__ == "__main__":
    main()
