"""CPU of one Spark sink task, without Spark: where a task's time goes, per variant of the write path.

The Spark benchmark (``bench_spark_sink.py``) runs on a shared 2-core machine
where the tasks, the JVM and the broker compete for the same cores: a task's
*CPU* per record decides its throughput there, and it is what this benchmark
measures, stable under load.  Each variant writes the same ``--records`` rows
(Arrow batches of 10,000 rows: a key, a ``--value-bytes`` value and the row-hash
column the driver adds) to a 2-partition topic, in interleaved rounds:

- ``per-record produce``: ``TwoPhaseCommitProducer.produce`` per row, a delivery
  report per row (the sink's path before ``produce_batch``);
- ``produce_batch, all reports``: the sink's ``write_partition`` with
  ``kafka2pc.delivery.reports=all``;
- ``produce_batch, error reports``: ``write_partition`` as the sink runs it
  (``kafka2pc.delivery.reports=errors``, the anchor asked of the partition leader);
- ``plain producer``: a ``confluent_kafka.Producer`` without transactions,
  ``produce`` per row, no delivery callback (the bench's at-least-once baseline).

Prints a table and replaces the ``## Spark sink: one task's CPU`` section of ``benchmarks/RESULTS.md``.

    python benchmarks/bench_spark_task.py --records 100000 --rounds 7
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import resource
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
from confluent_kafka import Producer

from kafka2pc import QueueFullError, TwoPhaseCommitProducer
from kafka2pc.recipes.spark._config import executor_config
from kafka2pc.recipes.spark._executor import WriterSpec, _shared_admin, batch_fingerprint, write_partition
from kafka2pc.testing import create_topic

from _results import record_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HASH = "__kafka2pc_row_hash"


def make_batches(records: int, value_bytes: int) -> list[pa.RecordBatch]:
    pad = "x" * max(0, value_bytes - 12)
    batches = []
    for start in range(0, records, 10_000):
        ids = range(start, min(start + 10_000, records))
        batches.append(pa.RecordBatch.from_arrays(
            [pa.array([str(i % 1000) for i in ids]), pa.array([f"{i:012d}{pad}" for i in ids]),
             pa.array([random.getrandbits(63) for _ in ids], pa.int64())],
            names=["key", "value", HASH],
        ))
    return batches


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread: Python and librdkafka's
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-append", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    if args.bootstrap is None:
        from kafka2pc.testing.broker import LocalKafka

        args.bootstrap = LocalKafka.up().bootstrap_servers
    bootstrap: str = args.bootstrap
    topic = create_topic(bootstrap, partitions=2)
    batches = make_batches(args.records, args.value_bytes)
    base = executor_config({"bootstrap.servers": bootstrap}, 60_000)

    def sink_task(reports: str) -> Callable[[], Any]:
        def run() -> Any:
            config = dict(base, **{"kafka2pc.delivery.reports": reports})
            spec = WriterSpec(config, f"bench-task-{uuid.uuid4().hex[:8]}", topic, ("key", "value"), 0,
                              fingerprint_column=HASH)
            return write_partition(spec, iter(batches), 0, 0)
        return run

    def per_record() -> Any:
        config = dict(base, **{"kafka2pc.delivery.reports": "all",
                               "transactional.id": f"bench-task-{uuid.uuid4().hex[:8]}"})
        started = time.monotonic()
        producer = TwoPhaseCommitProducer(config, control_plane=_shared_admin(config).control_plane)
        producer.init_transactions()
        producer.begin_transaction()
        opened = time.monotonic()
        spec = WriterSpec(config, "unused", topic, ("key", "value"), 0, fingerprint_column=HASH)
        for batch in batches:
            values = batch.column(1).to_pylist()
            keys = batch.column(0).to_pylist()
            for value, key in zip(values, keys, strict=True):
                while True:
                    try:
                        producer.produce(topic, value, key)
                        break
                    except QueueFullError:
                        producer.poll(0.05)
            batch_fingerprint(spec, batch)
            producer.poll(0)
        written = time.monotonic()
        producer.prepare_transaction()
        prepared = time.monotonic()
        producer.abort_transaction()
        producer.close()
        return (opened - started, written - opened, prepared - written)

    def plain() -> Any:
        started = time.monotonic()
        producer = Producer({"bootstrap.servers": bootstrap, "enable.sparse.connections": False})
        opened = time.monotonic()
        for batch in batches:
            values = batch.column(1).to_pylist()
            keys = batch.column(0).to_pylist()
            for value, key in zip(values, keys, strict=True):
                while True:
                    try:
                        producer.produce(topic, value, key)
                        break
                    except BufferError:
                        producer.poll(0.05)
            producer.poll(0)
        written = time.monotonic()
        if producer.flush(60) != 0:
            raise RuntimeError("plain: records not delivered")
        return (opened - started, written - opened, time.monotonic() - written)

    variants: dict[str, Callable[[], Any]] = {
        "per-record produce, all reports (the first sink)": per_record,
        "produce_batch, all reports": sink_task("all"),
        "produce_batch, error reports (the sink now)": sink_task("errors"),
        "plain producer, no transaction, no callback (baseline)": plain,
    }
    for run in variants.values():  # warm-up: connections, imports, the shared control plane
        run()
    results: dict[str, list[tuple[float, float, tuple[float, float, float]]]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        order = list(variants.items()) if round_ % 2 == 0 else list(reversed(variants.items()))
        for name, run in order:
            c0, t0 = cpu_s(), time.monotonic()
            out = run()
            t1, c1 = time.monotonic(), cpu_s()
            parts = (out.open_s, out.write_s, out.prepare_s) if hasattr(out, "open_s") else out
            results[name].append((c1 - c0, t1 - t0, parts))

    med = statistics.median
    per = args.records / 1000
    base_cpu = med(r[0] for r in results["per-record produce, all reports (the first sink)"])
    lines = [
        f"records={args.records} value={args.value_bytes}B rounds={args.rounds} cores={os.cpu_count()} "
        f"load={os.getloadavg()[0]:.1f}; CPU = the process's user+system time (Python and librdkafka threads)",
        "",
        "| variant | CPU s (median) | µs CPU / record | vs before | wall s | open s | produce s | prepare s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rs in results.items():
        cpu = med(r[0] for r in rs)
        lines.append(
            f"| {name} | {cpu:.3f} | {cpu / per * 1000:.2f} | {cpu / base_cpu:.2f}x | {med(r[1] for r in rs):.3f} | "
            f"{med(r[2][0] for r in rs):.3f} | {med(r[2][1] for r in rs):.3f} | {med(r[2][2] for r in rs):.3f} |"
        )
    text = "\n".join(lines)
    print(text)
    if not args.no_append:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        record_section("Spark sink: one task's CPU", f"`benchmarks/bench_spark_task.py`, {stamp}\n\n{text}")


if __name__ == "__main__":
    main()
