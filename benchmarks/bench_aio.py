"""How to drive librdkafka from asyncio: one thread per producer vs confluent-kafka's AIOProducer.

Runs, against the same broker in the same process, ``--producers`` producers
on one event loop (or on threads, for the sync reference), each doing
``--txns`` transactions of ``--records`` records per round:

* **kafka2pc.aio**: ``AsyncTwoPhaseCommitProducer`` (one dedicated thread per
  producer): begin -> produce N -> prepare -> commit;
* **AIOProducer**: ``confluent_kafka.aio.AIOProducer`` (experimental; blocking
  calls in a thread pool, 4 workers per producer by default, batched
  produce): begin -> produce N -> commit.  Plain Kafka transactions, no 2PC
  layer: it does less work than kafka2pc.aio;
* **to_thread**: the sync ``TwoPhaseCommitProducer`` with each blocking call
  in ``asyncio.to_thread`` (the loop's shared default pool), produce on the loop;
* **sync threads** (reference, no loop): the sync ``TwoPhaseCommitProducer``,
  one OS thread per producer.

Then an **isolation** run: 8 producers of each asyncio variant wait on an
unreachable cluster (their ``init_transactions`` hangs until its timeout)
while one producer of the same variant does 5 transactions on the live broker;
the live producer's time is reported.  A shared pool (``to_thread``) is
exhausted by the stuck calls; a thread per producer is not.

Every asyncio variant runs under :class:`kafka2pc.aio.LoopStallMonitor`
(a 1 ms ticker): the loop's longest stall and its p99 are reported next to
the throughput.  Rounds are interleaved and rotated so that drifts in machine
load hit every variant alike; ratios are medians of per-round ratios against
kafka2pc.aio.

Usage::

    python benchmarks/bench_aio.py                       # local broker (started or reused)
    python benchmarks/bench_aio.py --producers 8 --rounds 8 --record

Prints a Markdown table; ``--record`` also writes it to ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import platform
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import confluent_kafka

from kafka2pc import TwoPhaseCommitProducer
from kafka2pc.aio import AsyncTwoPhaseCommitProducer, LoopStallMonitor
from kafka2pc.testing import create_topic, drain

from _results import record_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script

VARIANTS = ("kafka2pc.aio", "AIOProducer", "to_thread", "sync threads")
# How to recognise the Python threads each driver adds (librdkafka's C threads are the same for all).
THREAD_PREFIX = {"kafka2pc.aio": "kafka2pc-aio-", "AIOProducer": "ThreadPoolExecutor-", "to_thread": "asyncio_",
                 "sync threads": "sync-thread-"}


@dataclass
class Sample:
    txn_per_s: float
    max_stall_ms: float | None = None
    p99_stall_ms: float | None = None


@dataclass
class Totals:
    samples: dict[str, list[Sample]] = field(default_factory=lambda: {v: [] for v in VARIANTS})
    driver_threads: dict[str, int] = field(default_factory=dict)
    isolation: dict[str, tuple[float, int]] = field(default_factory=dict)
    produced: int = 0


def _config(bootstrap: str, name: str) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, "transactional.id": f"bench-aio-{name}-{uuid.uuid4().hex[:8]}",
            "linger.ms": 5}


# -- the variants: set up producers (untimed), then one timed round ------------------------------

class AioVariant:
    name = "kafka2pc.aio"

    async def setup(self, bootstrap: str, producers: int) -> None:
        self.producers = [AsyncTwoPhaseCommitProducer(_config(bootstrap, f"k{n}")) for n in range(producers)]
        await asyncio.gather(*(p.init_transactions(60) for p in self.producers))

    async def round(self, topic: str, txns: int, payload: bytes, records: int) -> None:
        async def one(p: AsyncTwoPhaseCommitProducer) -> None:
            for _ in range(txns):
                await p.begin_transaction()
                for _ in range(records):
                    await p.produce(topic, value=payload)
                await p.prepare_transaction(60)
                await p.commit_transaction(60)

        await asyncio.gather(*(one(p) for p in self.producers))

    async def close(self) -> None:
        await asyncio.gather(*(p.close() for p in self.producers))


class AIOProducerVariant:
    name = "AIOProducer"

    async def setup(self, bootstrap: str, producers: int) -> None:
        from confluent_kafka.aio import AIOProducer

        self.producers = [AIOProducer(_config(bootstrap, f"c{n}")) for n in range(producers)]
        await asyncio.gather(*(p.init_transactions(60) for p in self.producers))

    async def round(self, topic: str, txns: int, payload: bytes, records: int) -> None:
        async def one(p: Any) -> None:
            for _ in range(txns):
                await p.begin_transaction()
                for _ in range(records):
                    await p.produce(topic, value=payload)
                await p.commit_transaction(60)  # flushes its batch buffer, then commits

        await asyncio.gather(*(one(p) for p in self.producers))

    async def close(self) -> None:
        await asyncio.gather(*(p.close() for p in self.producers))


class ToThreadVariant:
    name = "to_thread"

    async def setup(self, bootstrap: str, producers: int) -> None:
        self.producers = [TwoPhaseCommitProducer(_config(bootstrap, f"t{n}")) for n in range(producers)]
        await asyncio.gather(*(asyncio.to_thread(p.init_transactions, 60) for p in self.producers))

    async def round(self, topic: str, txns: int, payload: bytes, records: int) -> None:
        async def one(p: TwoPhaseCommitProducer) -> None:
            for _ in range(txns):
                await asyncio.to_thread(p.begin_transaction)
                for _ in range(records):
                    p.produce(topic, value=payload)  # an enqueue; reports are served by prepare's flush
                await asyncio.to_thread(p.prepare_transaction, 60)
                await asyncio.to_thread(p.commit_transaction, 60)

        await asyncio.gather(*(one(p) for p in self.producers))

    async def close(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(p.close) for p in self.producers))


def sync_threads_round(producers: list[TwoPhaseCommitProducer], topic: str, txns: int, payload: bytes,
                       records: int) -> float:
    def one(p: TwoPhaseCommitProducer) -> None:
        for _ in range(txns):
            p.begin_transaction()
            for _ in range(records):
                p.produce(topic, value=payload)
            p.prepare_transaction(60)
            p.commit_transaction(60)

    threads = [threading.Thread(target=one, args=(p,), name=f"sync-thread-{n}") for n, p in enumerate(producers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


# -- isolation: a live producer next to producers stuck on a dead cluster -----------------------------

ISOLATION_STUCK = 8
ISOLATION_TXNS = 5


async def isolation(name: str, bootstrap: str, dead: str, topic: str) -> tuple[float, int]:
    """Seconds the live producer of variant ``name`` needs for 5 transactions; stuck calls still pending then."""
    stuck: list[asyncio.Future[Any]] = []
    if name == "kafka2pc.aio":
        dead_producers: list[Any] = [AsyncTwoPhaseCommitProducer(_config(dead, f"d{n}")) for n in range(ISOLATION_STUCK)]
        stuck = [asyncio.ensure_future(p.init_transactions(10)) for p in dead_producers]
    elif name == "to_thread":
        dead_producers = [TwoPhaseCommitProducer(_config(dead, f"d{n}")) for n in range(ISOLATION_STUCK)]
        stuck = [asyncio.ensure_future(asyncio.to_thread(p.init_transactions, 10)) for p in dead_producers]
    else:
        from confluent_kafka.aio import AIOProducer

        dead_producers = [AIOProducer(_config(dead, f"d{n}")) for n in range(ISOLATION_STUCK)]
        stuck = [asyncio.ensure_future(p.init_transactions(10)) for p in dead_producers]
    await asyncio.sleep(0.2)  # the stuck calls have started
    variant: Any = {"kafka2pc.aio": AioVariant, "to_thread": ToThreadVariant, "AIOProducer": AIOProducerVariant}[name]()
    start = time.perf_counter()
    await variant.setup(bootstrap, 1)
    await variant.round(topic, ISOLATION_TXNS, b"x" * 100, 1)
    elapsed = time.perf_counter() - start
    still = sum(1 for f in stuck if not f.done())
    await asyncio.gather(*stuck, return_exceptions=True)  # let them end before the next variant
    await variant.close()
    return elapsed, still


# -- the driver ----------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> tuple[Totals, str]:
    if args.bootstrap:
        bootstrap = args.bootstrap
    else:
        from kafka2pc.testing.broker import LocalKafka

        bootstrap = LocalKafka.up().bootstrap_servers
    topic = create_topic(bootstrap, partitions=args.partitions)
    payload = b"x" * args.size
    totals = Totals()
    per_round = args.producers * args.txns

    sync_producers = [TwoPhaseCommitProducer(_config(bootstrap, f"s{n}")) for n in range(args.producers)]
    for p in sync_producers:
        p.init_transactions(60)

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    variants: dict[str, Any] = {"kafka2pc.aio": AioVariant(), "AIOProducer": AIOProducerVariant(),
                                "to_thread": ToThreadVariant()}
    for variant in variants.values():
        loop.run_until_complete(variant.setup(bootstrap, args.producers))

    async def timed(name: str, body: Awaitable[None]) -> Sample:
        async with LoopStallMonitor() as monitor:
            start = time.perf_counter()
            await body
            elapsed = time.perf_counter() - start
            alive = sum(1 for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX[name]))
            totals.driver_threads[name] = max(totals.driver_threads.get(name, 0), alive)
        report = monitor.report
        return Sample(per_round / elapsed, report.max_stall_s * 1e3, report.percentile_s(0.99) * 1e3)

    def one_round(name: str, warm: bool) -> None:
        if name == "sync threads":
            elapsed = sync_threads_round(sync_producers, topic, args.txns, payload, args.records)
            sample = Sample(per_round / elapsed)
            totals.driver_threads[name] = args.producers
        else:
            sample = loop.run_until_complete(
                timed(name, variants[name].round(topic, args.txns, payload, args.records))
            )
        totals.produced += per_round * args.records
        if not warm:
            totals.samples[name].append(sample)

    for name in VARIANTS:  # warm-up: connections, coordinators, partition registration
        one_round(name, warm=True)
    order = list(VARIANTS)
    for r in range(args.rounds):
        rotated = order[r % len(order):] + order[: r % len(order)]
        for name in rotated:
            one_round(name, warm=False)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {totals.samples[n][-1].txn_per_s:.0f}" for n in VARIANTS), file=sys.stderr)

    for variant in variants.values():
        loop.run_until_complete(variant.close())
    if args.isolation:
        from kafka2pc.testing.broker import port_base

        dead = f"127.0.0.1:{port_base() + 1999}"  # nothing listens there
        for name in ("kafka2pc.aio", "AIOProducer", "to_thread"):
            totals.isolation[name] = loop.run_until_complete(isolation(name, bootstrap, dead, topic))
            totals.produced += ISOLATION_TXNS
            print(f"isolation {name}: {totals.isolation[name]}", file=sys.stderr)
    loop.close()
    for p in sync_producers:
        p.close()
    visible = len(drain(bootstrap, topic, timeout=120))
    return totals, f"{visible} of {totals.produced}"


def table(totals: Totals, args: argparse.Namespace, visible: str) -> str:
    base = totals.samples["kafka2pc.aio"]
    lines = [
        f"`python benchmarks/bench_aio.py --producers {args.producers} --txns {args.txns} --records {args.records} "
        f"--rounds {args.rounds}` — {time.strftime('%Y-%m-%d %H:%M')}, librdkafka {confluent_kafka.libversion()[0]}, "
        f"confluent-kafka {confluent_kafka.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, sys.getswitchinterval() = {sys.getswitchinterval() * 1e3:.0f} ms.",
        "",
        f"{args.producers} producers on one event loop (or {args.producers} threads), each {args.txns} transactions "
        f"of {args.records} records of {args.size} bytes per round, {args.partitions} partitions; "
        f"{args.rounds} interleaved rounds after one warm-up round. Loop stall = lateness of a 1 ms ticker "
        "(LoopStallMonitor), per round; the table gives the median over rounds and the worst round.",
        "",
        "| variant | txn/s (median) | min..max | / kafka2pc.aio | loop stall p99 ms (median) | max stall ms (median / worst) | driver threads |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in VARIANTS:
        samples = totals.samples[name]
        rates = [s.txn_per_s for s in samples]
        ratio = statistics.median(s.txn_per_s / b.txn_per_s for s, b in zip(samples, base))
        if samples[0].max_stall_ms is None:
            stall_p99, stall_max = "-", "-"
        else:
            stall_p99 = f"{statistics.median(s.p99_stall_ms or 0 for s in samples):.1f}"
            maxes = [s.max_stall_ms or 0 for s in samples]
            stall_max = f"{statistics.median(maxes):.1f} / {max(maxes):.1f}"
        lines.append(
            f"| {name} | {statistics.median(rates):.0f} | {min(rates):.0f}..{max(rates):.0f} | {ratio:.2f}x "
            f"| {stall_p99} | {stall_max} | {totals.driver_threads.get(name, 0)} |"
        )
    if totals.isolation:
        lines += [
            "",
            f"Isolation: seconds one producer needs for init + {ISOLATION_TXNS} transactions on the live broker "
            f"while {ISOLATION_STUCK} producers of the same variant wait on an unreachable cluster "
            "(init_transactions, 10 s librdkafka timeout; kafka2pc's control plane waits up to its 30 s bootstrap "
            "timeout):",
            "",
            "| variant | live producer, s | stuck calls still pending then |",
            "|---|---:|---:|",
        ]
        for name, (seconds, still) in totals.isolation.items():
            lines.append(f"| {name} | {seconds:.2f} | {still} of {ISOLATION_STUCK} |")
    lines += ["", f"Records visible to read_committed at the end: {visible} produced.",
              "Driver threads: the Python threads the variant adds to drive its producers (the most seen at the "
              "end of a round); each librdkafka producer also runs its own C threads, the same for every variant."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", help="bootstrap servers (default: a local broker, started or reused)")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--txns", type=int, default=25)
    parser.add_argument("--records", type=int, default=10)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--no-isolation", dest="isolation", action="store_false",
                        help="skip the run next to producers stuck on an unreachable cluster")
    parser.add_argument("--record", action="store_true", help="write the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # the isolation run's refused connections
    totals, visible = run(args)
    text = table(totals, args, visible)
    print(text)
    if args.record:
        record_section("asyncio: kafka2pc.aio vs AIOProducer vs to_thread", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
