"""Throughput of the asyncio dual write against the sync recipe, at 16 and 64 concurrent requests.

A "request" is what ``examples/fastapi_orders.py`` does per ``POST /orders``:
borrow a free writer, open a Session, insert one row, produce one record,
commit both (``DualWriter.transaction`` / ``AsyncDualWriter.transaction``).
Both variants share ``W`` writers (``W`` transactional ids), so the Kafka
and database work per transaction is the same:

* **sync**: ``C`` threads, each looping over requests (``C`` = the
  concurrency), a thread-safe queue of ``W`` ``DualWriter``s (sync engine);
* **async**: ``C`` tasks on one event loop, an ``asyncio.Queue`` of ``W``
  ``AsyncDualWriter``s (async engine, psycopg's async driver); their Kafka
  calls run in one thread per writer (``kafka2pc.aio``).

Configurations are ``CxW``: 16x4 and 64x4 (the example's 4 writers), 16x16
(one writer per thread, the sync recipe's best case).  Rounds are interleaved
(the order alternates), ratios are medians of per-round ratios; the loop's
stalls (``LoopStallMonitor``) are recorded for the async variant.

Run::

    python benchmarks/bench_aio_dual_write.py [--rounds 3] [--seconds 3] [--configs 16x4,64x4,16x16]

Kafka: ``$KAFKA_BOOTSTRAP_SERVERS`` or the local broker (started if needed).
PostgreSQL: ``$KAFKA2PC_PG_ADMIN_URL`` (a fresh database is created and dropped).
Results are printed and recorded under "## asyncio dual write" in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import queue
import statistics
import threading
import time
import uuid
from datetime import datetime, timezone

import sqlalchemy as sa
from kafka2pc.recipes.dual_write import DualWriter, define_state_table
from kafka2pc.recipes.dual_write.aio import AsyncDualWriter
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from kafka2pc.aio import LoopStallMonitor
from kafka2pc.testing import create_topic
from kafka2pc.testing.postgres import fresh_database

from _results import record_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HEADING = "asyncio dual write"
PAYLOAD = "x" * 180


def _bootstrap() -> str:
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    from kafka2pc.testing.broker import LocalKafka

    return LocalKafka.up().bootstrap_servers


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


class Bench:
    def __init__(self, url: str, bootstrap: str, max_writers: int, max_concurrency: int) -> None:
        self.bootstrap = bootstrap
        metadata = sa.MetaData()
        self.states = define_state_table(metadata)
        self.orders = sa.Table("bench_aio_orders", metadata, sa.Column("id", sa.String(80), primary_key=True),
                               sa.Column("payload", sa.String(200)))
        self.engine = sa.create_engine(url, pool_size=max_writers + 2, max_overflow=max_concurrency)
        metadata.create_all(self.engine)
        self.topic = create_topic(bootstrap, partitions=3)
        self.run_id = uuid.uuid4().hex[:8]
        self.sync_writers = [
            DualWriter(self.engine, {"bootstrap.servers": bootstrap, "transactional.id": f"bench-aio-s-{self.run_id}-{i}"},
                       state_table=self.states)
            for i in range(max_writers)
        ]
        for w in self.sync_writers:
            w.recover()
        self.loop = asyncio.new_event_loop()
        self.async_engine: AsyncEngine = create_async_engine(url, pool_size=max_writers + 2, max_overflow=max_concurrency)
        self.async_writers = [
            AsyncDualWriter(self.async_engine, {"bootstrap.servers": bootstrap,
                                                "transactional.id": f"bench-aio-a-{self.run_id}-{i}"},
                            state_table=self.states)
            for i in range(max_writers)
        ]
        async def recover_all() -> None:
            await asyncio.gather(*(w.recover() for w in self.async_writers))

        self.loop.run_until_complete(recover_all())

    def sync_run(self, concurrency: int, writers: int, seconds: float, tag: str, kafka: bool = True) -> tuple[float, int]:
        free: queue.Queue[DualWriter] = queue.Queue()
        for w in self.sync_writers[:writers]:
            free.put(w)
        counts = [0] * concurrency
        barrier = threading.Barrier(concurrency + 1)
        stop = threading.Event()
        peak = [0]

        def request_loop(index: int) -> None:
            barrier.wait()
            n = 0
            while not stop.is_set():
                writer = free.get()
                try:
                    key = f"{tag}-{index}-{n}"
                    if kafka:
                        with Session(self.engine) as session, writer.transaction(session) as tx:
                            session.execute(self.orders.insert().values(id=key, payload=PAYLOAD))
                            tx.produce(self.topic, value=PAYLOAD, key=key)
                    else:  # the database work alone, same shape: the reference for the driver's own cost
                        with Session(self.engine) as session:
                            session.execute(self.orders.insert().values(id=key, payload=PAYLOAD))
                            session.commit()
                finally:
                    free.put(writer)
                n += 1
            counts[index] = n

        idle = _os_threads()
        threads = [threading.Thread(target=request_loop, args=(i,)) for i in range(concurrency)]
        for t in threads:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        time.sleep(seconds / 2)
        peak[0] = _os_threads()
        time.sleep(seconds / 2)
        stop.set()
        for t in threads:
            t.join()
        return sum(counts) / (time.perf_counter() - start), peak[0] - idle

    def async_run(
        self, concurrency: int, writers: int, seconds: float, tag: str, kafka: bool = True
    ) -> tuple[float, int, float, float]:
        async def main() -> tuple[float, int, float, float]:
            free: asyncio.Queue[AsyncDualWriter] = asyncio.Queue()
            for w in self.async_writers[:writers]:
                free.put_nowait(w)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + seconds
            count = 0

            async def request_loop(index: int) -> None:
                nonlocal count
                n = 0
                while loop.time() < deadline:
                    writer = await free.get()
                    try:
                        key = f"{tag}-{index}-{n}"
                        if kafka:
                            async with AsyncSession(self.async_engine) as session, writer.transaction(session) as tx:
                                await session.execute(self.orders.insert().values(id=key, payload=PAYLOAD))
                                await tx.produce(self.topic, value=PAYLOAD, key=key)
                        else:
                            async with AsyncSession(self.async_engine) as session:
                                await session.execute(self.orders.insert().values(id=key, payload=PAYLOAD))
                                await session.commit()
                    finally:
                        free.put_nowait(writer)
                    n += 1
                    count += 1

            async def sample() -> int:
                await asyncio.sleep(seconds / 2)
                return _os_threads()

            idle = _os_threads()
            async with LoopStallMonitor() as monitor:
                start = time.perf_counter()
                peak, *_ = await asyncio.gather(sample(), *(request_loop(i) for i in range(concurrency)))
                elapsed = time.perf_counter() - start
            return count / elapsed, peak - idle, monitor.report.percentile_s(0.99), monitor.report.max_stall_s

        return self.loop.run_until_complete(main())

    def close(self) -> None:
        for w in self.sync_writers:
            w.close()

        async def close_async() -> None:
            for w in self.async_writers:
                await w.close()
            await self.async_engine.dispose()

        self.loop.run_until_complete(close_async())
        self.loop.close()
        self.engine.dispose()


def run(rounds: int, seconds: float, configs: list[tuple[int, int]]) -> list[dict[str, float]]:
    bootstrap = _bootstrap()
    results = []
    with fresh_database() as url:
        bench = Bench(url, bootstrap, max(w for _, w in configs), max(c for c, _ in configs))
        try:
            for concurrency, writers in configs:
                tag = f"{bench.run_id}-{concurrency}x{writers}"
                bench.sync_run(concurrency, writers, 0.5, f"{tag}-warm-s")
                bench.async_run(concurrency, writers, 0.5, f"{tag}-warm-a")
                bench.sync_run(concurrency, writers, 0.5, f"{tag}-warm-sd", kafka=False)
                bench.async_run(concurrency, writers, 0.5, f"{tag}-warm-ad", kafka=False)
                sync_rates: list[float] = []
                async_rates: list[float] = []
                db_ratios: list[float] = []
                sync_threads: list[int] = []
                async_threads: list[int] = []
                p99s: list[float] = []
                maxima: list[float] = []
                for r in range(rounds):
                    order = ["sync", "async"] if r % 2 == 0 else ["async", "sync"]
                    for variant in order:
                        if variant == "sync":
                            rate, threads = bench.sync_run(concurrency, writers, seconds, f"{tag}-{r}-s")
                            sync_rates.append(rate)
                            sync_threads.append(threads)
                        else:
                            rate, threads, p99, worst = bench.async_run(concurrency, writers, seconds, f"{tag}-{r}-a")
                            async_rates.append(rate)
                            async_threads.append(threads)
                            p99s.append(p99)
                            maxima.append(worst)
                    db_sync = bench.sync_run(concurrency, writers, seconds / 2, f"{tag}-{r}-sd", kafka=False)[0]
                    db_async = bench.async_run(concurrency, writers, seconds / 2, f"{tag}-{r}-ad", kafka=False)[0]
                    db_ratios.append(db_async / db_sync)
                ratios = [a / s for a, s in zip(async_rates, sync_rates, strict=True)]
                results.append({
                    "concurrency": concurrency, "writers": writers,
                    "sync": statistics.median(sync_rates), "async": statistics.median(async_rates),
                    "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                    "db_ratio": statistics.median(db_ratios),
                    "sync_threads": statistics.median(sync_threads),
                    "async_threads": statistics.median(async_threads),
                    "p99_ms": statistics.median(p99s) * 1e3, "max_ms": max(maxima) * 1e3,
                })
                print(_table(results[-1:]).splitlines()[-1], flush=True)
        finally:
            bench.close()
    return results


def _table(results: list[dict[str, float]]) -> str:
    lines = [
        "| concurrent requests | writers | sync txn/s | async txn/s | async / sync | min..max "
        "| database only: async / sync "
        "| threads serving requests, sync / async | OS threads added while running, sync / async "
        "| loop stall p99 / max, ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {int(r['concurrency'])} | {int(r['writers'])} | {r['sync']:.0f} | {r['async']:.0f} "
            f"| **{r['ratio']:.2f}x** | {r['ratio_min']:.2f}..{r['ratio_max']:.2f} | {r['db_ratio']:.2f}x "
            f"| {int(r['concurrency'])} / {1 + int(r['writers'])} "
            f"| {r['sync_threads']:.0f} / {r['async_threads']:.0f} | {r['p99_ms']:.1f} / {r['max_ms']:.1f} |"
        )
    return "\n".join(lines)


def _record(results: list[dict[str, float]], rounds: int, seconds: float) -> None:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (
        "`python benchmarks/bench_aio_dual_write.py`: requests per second (one row and one record per "
        "request, as `examples/fastapi_orders.py`) of the asyncio dual write "
        "(`kafka2pc.recipes.dual_write.aio.AsyncDualWriter`, C tasks on one event loop, psycopg's async driver) "
        "against the sync recipe (`DualWriter`, C threads), both sharing the same number of writers "
        f"(transactional ids) through a queue, on PostgreSQL. {rounds} interleaved rounds of {seconds:g} s per "
        "variant; txn/s are medians, ratios medians of per-round ratios. *Threads serving requests*: sync, one "
        "thread per concurrent request (the producer calls run in it); async, the loop's thread plus one thread "
        "per writer's producer (`kafka2pc.aio`). *OS threads added* is measured: the process's threads in the "
        "middle of a run minus those right before it (every writer of both variants, with its librdkafka threads "
        "and, for async, its producer thread, exists throughout). *Database only* runs the same requests "
        "without Kafka and without the recipe (a Session, one INSERT, COMMIT; async: `AsyncSession` on psycopg's "
        "async driver), interleaved in the same rounds (half as long): the cost of SQLAlchemy's asyncio extension "
        "itself on this machine, the reference for what asyncio alone costs there. Goal: async at least equal to sync, at "
        "a fraction of the threads.\n\n"
        f"{_table(results)}\n\n"
        f"Measured {when} on {platform.machine()}, {os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f} "
        f"at the end), Python {platform.python_version()}, local single-node Kafka and PostgreSQL on the same "
        "machine.\n"
    )
    record_section(HEADING, section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--configs", default="16x4,64x4,16x16", help="CONCURRENCYxWRITERS, comma-separated")
    parser.add_argument("--no-record", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = parser.parse_args()
    configs = [(int(c), int(w)) for c, w in (item.split("x") for item in args.configs.split(","))]
    results = run(args.rounds, args.seconds, configs)
    print(_table(results))
    if not args.no_record:
        _record(results, args.rounds, args.seconds)


if __name__ == "__main__":
    main()
