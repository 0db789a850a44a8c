"""Throughput of the asyncio pipelined pool against an asyncio non-atomic write, at 16 and 64 concurrent requests.

A "request" inserts one row and produces one record, as ``examples/fastapi_orders.py`` does per
``POST /orders``.  Three variants, each with ``W`` transactional ids, on PostgreSQL:

* **async non-atomic** (the baseline an asyncio service writes without kafka2pc): ``C`` tasks on one
  event loop; each request opens an ``AsyncSession`` (psycopg's async driver), inserts, COMMITs, then
  runs a plain Kafka transaction on one of ``W`` confluent-kafka ``AIOProducer``\\ s (borrowed through an
  ``asyncio.Queue``): begin, produce, commit.  Nothing ties the two commits together;
* **async non-atomic, kafka2pc**: the same, with kafka2pc's ``AsyncTwoPhaseCommitProducer`` in a
  plain transaction (begin, produce, commit: no prepare) instead of ``AIOProducer``.  The ratios are
  against the faster of the two non-atomic writes in each round (the baseline a service would pick);
* **async pipelined pool**: ``AsyncWriterPool(pipelined=True)`` with ``size = max_slots = W``, ``C``
  tasks; the ``async with`` block returns once the database COMMIT is durable;
* **sync pipelined pool**: ``WriterPool(pipelined=True)``, the same ids, ``C`` threads.

Rounds are interleaved (the order rotates), ratios are medians of per-round ratios with min..max.

Run::

    python benchmarks/bench_aio_pipelined.py [--rounds 3] [--seconds 3] [--configs 16x4,64x4,16x16]

Kafka: ``$KAFKA_BOOTSTRAP_SERVERS`` or the local broker (started if needed).
PostgreSQL: ``$KAFKA2PC_PG_ADMIN_URL`` (a fresh database is created and dropped).
Results are printed and recorded under "## asyncio pipelined pool" in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import threading
import time
import uuid
from datetime import datetime, timezone

import sqlalchemy as sa
from _results import record_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script
from bench_aio_dual_write import PAYLOAD, _bootstrap  # noqa: E402
from confluent_kafka.aio import AIOProducer
from kafka2pc.recipes.dual_write import WriterPool, define_lease_table, define_state_table
from kafka2pc.recipes.dual_write.aio import AsyncWriterPool
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from kafka2pc.aio import AsyncTwoPhaseCommitProducer
from kafka2pc.testing import create_topic
from kafka2pc.testing.postgres import fresh_database

HEADING = "asyncio pipelined pool"
VARIANTS = ("async non-atomic", "async non-atomic k2pc", "async pipelined", "sync pipelined")
BASELINES = ("async non-atomic", "async non-atomic k2pc")


class Bench:
    def __init__(self, url: str, bootstrap: str, max_writers: int, max_concurrency: int) -> None:
        self.bootstrap = bootstrap
        self.run_id = uuid.uuid4().hex[:8]
        metadata = sa.MetaData()
        self.states = define_state_table(metadata)
        self.leases = define_lease_table(metadata)
        self.orders = sa.Table("bench_aiop_orders", metadata, sa.Column("id", sa.String(80), primary_key=True),
                               sa.Column("payload", sa.String(200)))
        self.engine = sa.create_engine(url, pool_size=2 * max_writers + 4, max_overflow=max_concurrency)
        metadata.create_all(self.engine)
        self.topic = create_topic(bootstrap, partitions=3)
        self.loop = asyncio.new_event_loop()
        self.async_engine: AsyncEngine = create_async_engine(url, pool_size=2 * max_writers + 4,
                                                             max_overflow=max_concurrency)
        self.max_writers = max_writers

        async def producers() -> list[AIOProducer]:
            made = []
            for i in range(max_writers):
                producer = AIOProducer({"bootstrap.servers": bootstrap, "linger.ms": 0,
                                        "transactional.id": f"bench-aiop-n-{self.run_id}-{i}"})
                await producer.init_transactions()
                made.append(producer)
            return made

        self.producers = self.loop.run_until_complete(producers())

        async def k2pc_producers() -> list[AsyncTwoPhaseCommitProducer]:
            made = []
            for i in range(max_writers):
                producer = AsyncTwoPhaseCommitProducer({"bootstrap.servers": bootstrap, "linger.ms": 0,
                                                        "transactional.id": f"bench-aiop-k-{self.run_id}-{i}"})
                await producer.init_transactions()
                made.append(producer)
            return made

        self.k2pc_producers = self.loop.run_until_complete(k2pc_producers())

    def _pool_kwargs(self, writers: int, kind: str) -> dict[str, object]:
        return {"prefix": f"bench-aiop-{kind}-{self.run_id}-{writers}", "size": writers, "max_slots": writers,
                "pipelined": True, "state_table": self.states, "lease_table": self.leases}

    def nonatomic(self, concurrency: int, writers: int, seconds: float, tag: str, *, k2pc: bool = False) -> float:
        async def main() -> float:
            free: asyncio.Queue[AIOProducer | AsyncTwoPhaseCommitProducer] = asyncio.Queue()
            for p in (self.k2pc_producers if k2pc else self.producers)[:writers]:
                free.put_nowait(p)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + seconds
            count = 0

            async def request_loop(index: int) -> None:
                nonlocal count
                n = 0
                while loop.time() < deadline:
                    key = f"{tag}-{index}-{n}"
                    async with AsyncSession(self.async_engine) as session:
                        await session.execute(self.orders.insert().values(id=key, payload=PAYLOAD))
                        await session.commit()
                    producer = await free.get()
                    try:
                        await producer.begin_transaction()
                        await producer.produce(self.topic, value=PAYLOAD, key=key)
                        await producer.commit_transaction()
                    finally:
                        free.put_nowait(producer)
                    n += 1
                    count += 1

            start = time.perf_counter()
            await asyncio.gather(*(request_loop(i) for i in range(concurrency)))
            return count / (time.perf_counter() - start)

        return self.loop.run_until_complete(main())

    def open_pools(self, writers: int) -> None:
        """The two pools of one configuration, kept across its warm-up and rounds (their slots made once)."""
        self.sync_pool = WriterPool(self.engine, {"bootstrap.servers": self.bootstrap},
                                    **self._pool_kwargs(writers, "s"))  # type: ignore[arg-type]

        async def start() -> AsyncWriterPool:
            pool = AsyncWriterPool(self.async_engine, {"bootstrap.servers": self.bootstrap},
                                   **self._pool_kwargs(writers, "a"))  # type: ignore[arg-type]
            await pool.start()
            return pool

        self.async_pool = self.loop.run_until_complete(start())

    def close_pools(self) -> None:
        self.sync_pool.close()
        self.loop.run_until_complete(self.async_pool.close())

    def async_pipelined(self, concurrency: int, writers: int, seconds: float, tag: str) -> float:
        pool = self.async_pool

        async def main() -> float:
            loop = asyncio.get_running_loop()
            count = 0
            deadline = loop.time() + seconds

            async def request_loop(index: int) -> None:
                nonlocal count
                n = 0
                while loop.time() < deadline:
                    key = f"{tag}-{index}-{n}"
                    async with AsyncSession(self.async_engine) as session, pool.transaction(session) as tx:
                        await session.execute(self.orders.insert().values(id=key, payload=PAYLOAD))
                        await tx.produce(self.topic, value=PAYLOAD, key=key)
                    n += 1
                    count += 1

            start = time.perf_counter()
            await asyncio.gather(*(request_loop(i) for i in range(concurrency)))
            await pool.wait_visible()
            return count / (time.perf_counter() - start)

        return self.loop.run_until_complete(main())

    def sync_pipelined(self, concurrency: int, writers: int, seconds: float, tag: str) -> float:
        pool = self.sync_pool
        counts = [0] * concurrency
        barrier = threading.Barrier(concurrency + 1)
        stop = threading.Event()

        def request_loop(index: int) -> None:
            barrier.wait()
            n = 0
            while not stop.is_set():
                key = f"{tag}-{index}-{n}"
                with Session(self.engine) as session, pool.transaction(session) as tx:
                    session.execute(self.orders.insert().values(id=key, payload=PAYLOAD))
                    tx.produce(self.topic, value=PAYLOAD, key=key)
                n += 1
            counts[index] = n

        threads = [threading.Thread(target=request_loop, args=(i,)) for i in range(concurrency)]
        for t in threads:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        pool.wait_visible()
        return sum(counts) / (time.perf_counter() - start)

    def run_variant(self, variant: str, concurrency: int, writers: int, seconds: float, tag: str) -> float:
        run = {"async non-atomic": self.nonatomic, "async pipelined": self.async_pipelined,
               "async non-atomic k2pc": lambda c, w, s, t: self.nonatomic(c, w, s, t, k2pc=True),
               "sync pipelined": self.sync_pipelined}[variant]
        return run(concurrency, writers, seconds, tag)

    def close(self) -> None:
        async def close_async() -> None:
            for p in self.producers:
                await p.close()
            for k in self.k2pc_producers:
                await k.close()
            await self.async_engine.dispose()

        self.loop.run_until_complete(close_async())
        self.loop.close()
        self.engine.dispose()


def run(rounds: int, seconds: float, configs: list[tuple[int, int]]) -> list[dict[str, float]]:
    results = []
    with fresh_database() as url:
        bench = Bench(url, _bootstrap(), max(w for _, w in configs), max(c for c, _ in configs))
        try:
            for concurrency, writers in configs:
                tag = f"{bench.run_id}-{concurrency}x{writers}"
                bench.open_pools(writers)
                for variant in VARIANTS:  # warm-up: connections, producers, the pools' ids
                    bench.run_variant(variant, concurrency, writers, 0.5, f"{tag}-warm-{variant[:3]}{variant[-3:]}")
                rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
                for r in range(rounds):
                    order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
                    for variant in order:
                        rates[variant].append(bench.run_variant(variant, concurrency, writers, seconds,
                                                                f"{tag}-{r}-{VARIANTS.index(variant)}"))
                bench.close_pools()
                faster = [max(a, k) for a, k in zip(*(rates[b] for b in BASELINES), strict=True)]
                vs_nonatomic = [a / b for a, b in zip(rates["async pipelined"], faster, strict=True)]
                k2pc_vs_aio = [k / a for a, k in zip(*(rates[b] for b in BASELINES), strict=True)]
                vs_sync = [a / b for a, b in zip(rates["async pipelined"], rates["sync pipelined"], strict=True)]
                results.append({
                    "concurrency": concurrency, "writers": writers,
                    **{v: statistics.median(rates[v]) for v in VARIANTS},
                    "ratio": statistics.median(vs_nonatomic), "ratio_min": min(vs_nonatomic),
                    "ratio_max": max(vs_nonatomic), "vs_sync": statistics.median(vs_sync),
                    "vs_sync_min": min(vs_sync), "vs_sync_max": max(vs_sync),
                    "k2pc_vs_aio": statistics.median(k2pc_vs_aio),
                })
                print(_table(results[-1:]).splitlines()[-1], flush=True)
        finally:
            bench.close()
    return results


def _table(results: list[dict[str, float]]) -> str:
    lines = [
        "| concurrent requests | ids | async non-atomic (AIOProducer) txn/s | async non-atomic (kafka2pc.aio) txn/s "
        "| kafka2pc.aio / AIOProducer | async pipelined txn/s | sync pipelined txn/s "
        "| async pipelined / faster async non-atomic (min..max) | async pipelined / sync pipelined (min..max) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {int(r['concurrency'])} | {int(r['writers'])} | {r['async non-atomic']:.0f} "
            f"| {r['async non-atomic k2pc']:.0f} | {r['k2pc_vs_aio']:.2f}x "
            f"| {r['async pipelined']:.0f} | {r['sync pipelined']:.0f} "
            f"| **{r['ratio']:.2f}x** ({r['ratio_min']:.2f}..{r['ratio_max']:.2f}) "
            f"| {r['vs_sync']:.2f}x ({r['vs_sync_min']:.2f}..{r['vs_sync_max']:.2f}) |"
        )
    return "\n".join(lines)


def _record(results: list[dict[str, float]], rounds: int, seconds: float) -> None:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (
        "`python benchmarks/bench_aio_pipelined.py`: requests per second (one row and one record per request) of "
        "`AsyncWriterPool(pipelined=True)` against the asyncio non-atomic write (an `AsyncSession` COMMIT, then a "
        "plain transaction on a confluent-kafka `AIOProducer` or on kafka2pc's `AsyncTwoPhaseCommitProducer`; "
        "the ratio is against the faster of the two in each round) and against the sync "
        "`WriterPool(pipelined=True)`, "
        f"on PostgreSQL, with the same number of transactional ids. {rounds} interleaved rounds of {seconds:g} s per "
        "variant; txn/s are medians, ratios medians of per-round ratios (min..max).\n\n"
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
    parser.add_argument("--configs", default="16x4,64x4,16x16", help="CONCURRENCYxIDS, comma-separated")
    parser.add_argument("--no-record", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = parser.parse_args()
    configs = [(int(c), int(w)) for c, w in (item.split("x") for item in args.configs.split(","))]
    results = run(args.rounds, args.seconds, configs)
    print(_table(results))
    if not args.no_record:
        _record(results, args.rounds, args.seconds)


if __name__ == "__main__":
    main()
