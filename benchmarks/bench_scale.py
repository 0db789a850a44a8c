"""How the pipelined pool scales with concurrent writers, and what an idle pool costs in the background.

**The curve.** For each count ``W`` of concurrent writers (threads), two variants on PostgreSQL, each
transaction one row and one record:

* **non-atomic**: what the application writes without kafka2pc, on ``W`` threads, each with its own
  plain confluent-kafka transactional producer and connection: INSERT, COMMIT, then begin, produce,
  commit on Kafka;
* **pipelined**: one ``WriterPool(pipelined=True)`` shared by the ``W`` threads (``size = max_slots =
  2 W``, or ``--max-slots``), the ``with`` block returning once the database COMMIT is durable.

Rounds are interleaved (the order alternates), each figure the median of the rounds, each ratio the median
of per-round ratios with min..max. The client's CPU per transaction and the load average are printed with
each row.

**The background.** ``--instances`` pools (one process, each its own engine, as that many service
instances) share a pool of 64 or 256 ids; after a burst of transactions has leased ``max_slots`` ids each
(the default, 8, or fewer when the ids do not go round),
they sit idle for ``--idle-s`` seconds. Counted meanwhile, through SQLAlchemy's ``before_cursor_execute``
event on their engines: lease renewals (UPDATEs of the lease table), orphan scans (SELECTs of it) and all
statements, per second; and the CPU of the client and of the benchmark database's PostgreSQL backends,
in milliseconds per second.

Run::

    python benchmarks/bench_scale.py [--writers 1,2,4,8,16,32,64] [--rounds 3] [--seconds 2]
        [--ids 64,256] [--instances 8] [--idle-s 30]

Kafka: ``$KAFKA_BOOTSTRAP_SERVERS`` or the local broker (started if needed).
PostgreSQL: ``$KAFKA2PC_PG_ADMIN_URL`` (a fresh database is created and dropped).
Results are printed and recorded under "## Scale" in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import threading
import time
import uuid
from collections import Counter
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from _results import record_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script
from bench_dual_write import PAYLOAD, CpuMeter, _bootstrap  # noqa: E402
from confluent_kafka import Producer
from kafka2pc.recipes.dual_write import WriterPool, define_lease_table, define_state_table

from kafka2pc.testing import create_topic
from kafka2pc.testing.postgres import fresh_database

HEADING = "Scale"


class Curve:
    """The two variants at every writer count, on one database and one topic."""

    def __init__(self, url: str, bootstrap: str, most: int) -> None:
        self.bootstrap = bootstrap
        self.run_id = uuid.uuid4().hex[:8]
        self.engine = sa.create_engine(url, pool_size=2 * most + 4, max_overflow=0)
        metadata = sa.MetaData()
        define_state_table(metadata)
        define_lease_table(metadata)
        self.orders = sa.Table("bench_scale_orders", metadata, sa.Column("id", sa.String(80), primary_key=True),
                               sa.Column("payload", sa.String(200)))
        metadata.create_all(self.engine)
        self.topic = create_topic(bootstrap, partitions=3)
        self.producers: list[Producer] = []

    def plain_producers(self, count: int) -> list[Producer]:
        while len(self.producers) < count:
            producer = Producer({"bootstrap.servers": self.bootstrap,
                                 "transactional.id": f"bench-scale-plain-{self.run_id}-{len(self.producers)}"})
            producer.init_transactions()
            self.producers.append(producer)
        return self.producers[:count]

    def run(self, variant: str, writers: int, seconds: float, tag: str, pool: WriterPool | None) -> tuple[float, float]:
        """Transactions per second, and the client's CPU milliseconds per transaction."""
        producers = self.plain_producers(writers) if variant == "non-atomic" else []
        counts = [0] * writers
        stop = threading.Event()
        barrier = threading.Barrier(writers + 1)

        def loop(index: int) -> None:
            with self.engine.connect() as conn:
                barrier.wait()
                n = 0
                while not stop.is_set():
                    key = f"{tag}-{index}-{n}"
                    if pool is None:
                        producer = producers[index]
                        conn.execute(self.orders.insert(), {"id": key, "payload": PAYLOAD})
                        conn.commit()
                        producer.begin_transaction()
                        producer.produce(self.topic, value=PAYLOAD, key=key)
                        producer.commit_transaction()
                    else:
                        with pool.transaction(conn) as tx:
                            tx.produce(self.topic, value=PAYLOAD, key=key)
                            conn.execute(self.orders.insert(), {"id": key, "payload": PAYLOAD})
                    n += 1
                counts[index] = n

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        barrier.wait()
        cpu0, start = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        if pool is not None:
            pool.wait_visible(60)  # the next variant starts with nothing in flight
        total = max(1, sum(counts))
        return sum(counts) / elapsed, 1000 * (time.process_time() - cpu0) / total

    def close(self) -> None:
        self.engine.dispose()


def curve(url: str, bootstrap: str, writer_counts: list[int], rounds: int, seconds: float,
          max_slots: int | None = None) -> list[dict[str, Any]]:
    bench = Curve(url, bootstrap, max(writer_counts))
    results = []
    try:
        for writers in writer_counts:
            pool = WriterPool(bench.engine, {"bootstrap.servers": bootstrap},
                              prefix=f"bench-scale-{bench.run_id}-w{writers}", size=2 * writers,
                              max_slots=max_slots or 2 * writers, pipelined=True)
            pool.start()
            try:
                tag = f"{bench.run_id}-w{writers}"
                for variant in ("non-atomic", "pipelined"):  # warm up: leases taken, producers made
                    bench.run(variant, writers, 0.5, f"{tag}-warm-{variant}", pool if variant == "pipelined" else None)
                rates: dict[str, list[float]] = {"non-atomic": [], "pipelined": []}
                cpu: dict[str, list[float]] = {"non-atomic": [], "pipelined": []}
                for r in range(rounds):
                    order = ["non-atomic", "pipelined"] if r % 2 == 0 else ["pipelined", "non-atomic"]
                    for variant in order:
                        rate, ms = bench.run(variant, writers, seconds, f"{tag}-{r}-{variant}",
                                             pool if variant == "pipelined" else None)
                        rates[variant].append(rate)
                        cpu[variant].append(ms)
            finally:
                pool.close()
            ratios = [p / n for p, n in zip(rates["pipelined"], rates["non-atomic"], strict=True)]
            row = {
                "writers": writers, "slots": max_slots or 2 * writers, "non_atomic": statistics.median(rates["non-atomic"]),
                "pipelined": statistics.median(rates["pipelined"]), "ratio": statistics.median(ratios),
                "min": min(ratios), "max": max(ratios), "cpu_non_atomic": statistics.median(cpu["non-atomic"]),
                "cpu_pipelined": statistics.median(cpu["pipelined"]), "load": os.getloadavg()[0],
            }
            results.append(row)
            print(_curve_table([row]).splitlines()[-1], flush=True)
    finally:
        bench.close()
    return results


def background(url: str, bootstrap: str, ids: int, instances: int, idle_s: float) -> dict[str, Any]:
    """Statements and CPU per second of ``instances`` idle pools sharing ``ids`` ids."""
    run_id = uuid.uuid4().hex[:8]
    meter = CpuMeter([], sa.make_url(url).database or "")
    counts: Counter[str] = Counter()
    counting = threading.Event()
    lease_table = define_lease_table(sa.MetaData())
    name = lease_table.name

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if counting.is_set():
            head = statement.lstrip().split(None, 1)[0].upper()
            counts["statements"] += 1
            if name in statement and head == "UPDATE":
                counts["renewals"] += 1
            elif name in statement and head == "SELECT":
                counts["scans"] += 1

    setup = sa.create_engine(url)
    metadata = sa.MetaData()
    define_state_table(metadata)
    define_lease_table(metadata)
    metadata.create_all(setup)
    setup.dispose()
    engines, pools = [], []
    try:
        slots = max(1, min(ids // instances, 8))  # the pool's default max_slots, within the ids
        for i in range(instances):
            engine = sa.create_engine(url, pool_size=slots + 4, max_overflow=4)
            sa.event.listen(engine, "before_cursor_execute", count)
            engines.append(engine)
            pool = WriterPool(engine, {"bootstrap.servers": bootstrap}, prefix=f"bench-bg-{run_id}-{ids}",
                              size=ids, max_slots=slots, owner=f"bench-{i}")
            pool.start()
            pools.append(pool)
        topic = create_topic(bootstrap, partitions=3)
        for pool in pools:  # a burst: every instance leases its slots, all at once
            together = threading.Barrier(slots, timeout=60)

            def burst(pool: WriterPool = pool, together: threading.Barrier = together) -> None:
                with pool.engine.connect() as conn, pool.transaction(conn) as tx:
                    tx.produce(topic, value=PAYLOAD)
                    conn.execute(sa.text("SELECT 1"))
                    together.wait()

            threads = [threading.Thread(target=burst) for _ in range(slots)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        held = sum(len(p.held_ids) for p in pools)
        client0, _, db0 = meter.read()
        counting.set()
        start = time.perf_counter()
        time.sleep(idle_s)
        counting.clear()
        elapsed = time.perf_counter() - start
        client1, _, db1 = meter.read()
    finally:
        for pool in pools:
            pool.close()
        for engine in engines:
            engine.dispose()
    return {
        "ids": ids, "instances": instances, "held": held,
        "renewals": counts["renewals"] / elapsed, "scans": counts["scans"] / elapsed,
        "statements": counts["statements"] / elapsed,
        "client_ms": 1000 * (client1 - client0) / elapsed, "db_ms": 1000 * (db1 - db0) / elapsed,
    }


def _curve_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| writers | pool slots | non-atomic txn/s | pipelined txn/s | **pipelined / non-atomic** | min..max "
        "| client CPU ms per txn, non-atomic / pipelined | load average |",
        "|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['writers']} | {r['slots']} | {r['non_atomic']:.0f} | {r['pipelined']:.0f} | **{r['ratio']:.2f}x** "
            f"| {r['min']:.2f}..{r['max']:.2f} | {r['cpu_non_atomic']:.2f} / {r['cpu_pipelined']:.2f} "
            f"| {r['load']:.1f} |"
        )
    return "\n".join(lines)


def _background_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| ids | instances | leases held | lease renewals/s | orphan scans/s | statements/s "
        "| client CPU ms/s | PostgreSQL CPU ms/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['ids']} | {r['instances']} | {r['held']} | {r['renewals']:.2f} | {r['scans']:.2f} "
            f"| {r['statements']:.2f} | {r['client_ms']:.1f} | {r['db_ms']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", default="1,2,4,8,16,32,64", help="concurrent writers, comma-separated")
    parser.add_argument("--max-slots", type=int, default=None,
                        help="the pool's max_slots (default: two per writer, so that no writer waits for a slot)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--ids", default="64,256", help="pool sizes of the background measure, comma-separated")
    parser.add_argument("--instances", type=int, default=8, help="idle pools sharing the ids")
    parser.add_argument("--idle-s", type=float, default=30.0, help="how long the background is measured")
    parser.add_argument("--skip-curve", action="store_true")
    parser.add_argument("--skip-background", action="store_true")
    parser.add_argument("--no-record", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = parser.parse_args()
    bootstrap, _ = _bootstrap()
    curve_rows: list[dict[str, Any]] = []
    background_rows: list[dict[str, Any]] = []
    with fresh_database() as url:
        if not args.skip_curve:
            curve_rows = curve(url, bootstrap, [int(w) for w in args.writers.split(",")], args.rounds, args.seconds,
                               args.max_slots)
        if not args.skip_background:
            for ids in (int(n) for n in args.ids.split(",")):
                background_rows.append(background(url, bootstrap, ids, args.instances, args.idle_s))
                print(_background_table(background_rows[-1:]).splitlines()[-1], flush=True)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = (
        f"`python benchmarks/bench_scale.py --rounds {args.rounds} --seconds {args.seconds:g} "
        f"--instances {args.instances} --idle-s {args.idle_s:g}`, {when}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, local single-node Kafka and PostgreSQL.\n\n"
    )
    if curve_rows:
        body += _curve_table(curve_rows) + "\n\n"
    if background_rows:
        body += _background_table(background_rows) + "\n"
    print(body)
    if not args.no_record:
        record_section(HEADING, body)
        print("recorded in benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
