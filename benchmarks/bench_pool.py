"""Throughput of a WriterPool against single DualWriters, at 1, 4 and 16 concurrent transactions in one process.

Every variant runs N threads, each doing transactions of one row and one
record on its own database connection, on PostgreSQL:

* **pool**: one :class:`WriterPool` (``max_slots=N``), shared by the N threads;
* **N writers**: N :class:`DualWriter`, one per thread, each with its own fixed id
  (what the pool has to match: the hand-made-ids deployment);
* **one writer**: one :class:`DualWriter` shared by the N threads (what an
  application without a pool gets: its transactions run one at a time).

Rounds are interleaved (the order rotates round by round) so that drift of
the shared machine hits every variant alike; ratios are medians of per-round
ratios.

Run::

    python benchmarks/bench_pool.py [--rounds 5] [--seconds 2] [--threads 1,4,16]

Kafka: ``$KAFKA_BOOTSTRAP_SERVERS`` or the local broker (started if needed).
PostgreSQL: ``$KAFKA2PC_PG_ADMIN_URL`` (a fresh database is created and dropped).
Results are printed and recorded under "## Writer pool: throughput" in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from kafka2pc.recipes.dual_write import DualWriter, WriterPool, define_lease_table, define_state_table

from kafka2pc.testing import create_topic
from kafka2pc.testing.postgres import fresh_database

from _results import record_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HEADING = "Writer pool: throughput"
PAYLOAD = "x" * 180


def _bootstrap() -> str:
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    from kafka2pc.testing.broker import LocalKafka

    return LocalKafka.up().bootstrap_servers


Step = Callable[[int, sa.Connection, str], None]


def _measure(engine: sa.Engine, step: Step, threads: int, seconds: float, tag: str) -> float:
    counts = [0] * threads
    barrier = threading.Barrier(threads + 1)
    stop = threading.Event()

    def loop(index: int) -> None:
        with engine.connect() as conn:
            barrier.wait()
            n = 0
            while not stop.is_set():
                step(index, conn, f"{tag}-{index}-{n}")
                n += 1
            counts[index] = n

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in workers:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def run(rounds: int, seconds: float, concurrency: list[int]) -> list[dict[str, Any]]:
    bootstrap = _bootstrap()
    config = {"bootstrap.servers": bootstrap}
    results = []
    with fresh_database() as url:
        engine = sa.create_engine(url, pool_size=2 * max(concurrency) + 8, max_overflow=16)
        metadata = sa.MetaData()
        define_state_table(metadata)
        define_lease_table(metadata)
        orders = sa.Table("bench_orders", metadata, sa.Column("id", sa.String(80), primary_key=True),
                          sa.Column("payload", sa.String(200)))
        metadata.create_all(engine)
        topic = create_topic(bootstrap, partitions=3)
        run_id = uuid.uuid4().hex[:6]
        for n in concurrency:
            pool = WriterPool(engine, config, prefix=f"bench-pool-{run_id}-{n}", size=n, max_slots=n,
                              state_table=define_state_table(sa.MetaData()))
            writers = [DualWriter(engine, {**config, "transactional.id": f"bench-single-{run_id}-{n}-{i}"},
                                  state_table=define_state_table(sa.MetaData())) for i in range(n)]
            for w in writers:
                w.recover()

            def write(tx: Any, conn: sa.Connection, key: str) -> None:
                tx.produce(topic, value=PAYLOAD, key=key)
                conn.execute(orders.insert().values(id=key, payload=PAYLOAD))

            def via_pool(i: int, conn: sa.Connection, key: str) -> None:
                with pool.transaction(conn) as tx:
                    write(tx, conn, key)

            def via_writers(i: int, conn: sa.Connection, key: str) -> None:
                with writers[i].transaction(conn) as tx:
                    write(tx, conn, key)

            def via_one(i: int, conn: sa.Connection, key: str) -> None:
                with writers[0].transaction(conn) as tx:
                    write(tx, conn, key)

            variants: dict[str, Step] = {"pool": via_pool, "writers": via_writers, "one": via_one}
            names = list(variants)
            for name in names:  # warm up: the pool leases and recovers its slots here
                _measure(engine, variants[name], n, 1.0, f"{run_id}-{n}-warm-{name}")
            rates: dict[str, list[float]] = {name: [] for name in names}
            for r in range(rounds):
                for name in names[r % 3:] + names[:r % 3]:
                    rates[name].append(_measure(engine, variants[name], n, seconds, f"{run_id}-{n}-{r}-{name}"))
            pool_vs_writers = [p / w for p, w in zip(rates["pool"], rates["writers"])]
            pool_vs_one = [p / o for p, o in zip(rates["pool"], rates["one"])]
            results.append({
                "threads": n, "pool": statistics.median(rates["pool"]), "writers": statistics.median(rates["writers"]),
                "one": statistics.median(rates["one"]), "ratio": statistics.median(pool_vs_writers),
                "ratio_min": min(pool_vs_writers), "ratio_max": max(pool_vs_writers),
                "vs_one": statistics.median(pool_vs_one), "slots": len(pool.held_ids),
            })
            print(_table(results[-1:]).splitlines()[-1], flush=True)
            pool.close()
            for w in writers:
                w.close()
        engine.dispose()
    return results


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| concurrent transactions | pool txn/s | N single writers txn/s | one writer, N threads txn/s "
        "| pool / N writers | min..max | pool / one writer | slots used |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['threads']} | {r['pool']:.1f} | {r['writers']:.1f} | {r['one']:.1f} | **{r['ratio']:.2f}x** "
            f"| {r['ratio_min']:.2f}..{r['ratio_max']:.2f} | {r['vs_one']:.2f}x | {r['slots']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--threads", default="1,4,16")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    results = run(args.rounds, args.seconds, [int(t) for t in args.threads.split(",")])
    table = _table(results)
    print(table)
    if not args.no_record:
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        record_section(HEADING, (
            "`python benchmarks/bench_pool.py`: transactions per second (one row and one record each) with N "
            "threads in one process, each on its own connection: one `WriterPool` (`max_slots=N`) against N "
            "`DualWriter`s with fixed ids (one per thread) and against one `DualWriter` shared by the N threads. "
            f"{args.rounds} interleaved rounds of {args.seconds:g} s per variant; txn/s are medians, ratios medians "
            "of per-round ratios.\n\n"
            f"{table}\n\n"
            f"Measured {when} on {platform.machine()}, {os.cpu_count()} CPUs (load average "
            f"{os.getloadavg()[0]:.1f} at the end), Python {platform.python_version()}, local single-node Kafka and "
            "PostgreSQL on the same machine.\n"
        ))
        print("recorded in benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
