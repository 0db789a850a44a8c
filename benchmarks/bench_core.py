"""What does kafka2pc cost per transaction?  TwoPhaseCommitProducer vs plain confluent-kafka.

Runs, against the same broker in the same process, two producers doing the same
work per transaction:

* **plain**: ``confluent_kafka.Producer``: begin -> produce 10 -> commit;
* **2pc**: ``kafka2pc.TwoPhaseCommitProducer``: begin -> produce 10 -> prepare -> commit.

Rounds are interleaved (plain/2pc, then 2pc/plain, ...) so that drifts in
machine load hit both alike; the ratio reported is the median of the per-round
ratios.  Broker requests per transaction are counted, not estimated:

* librdkafka's own statistics (``statistics.interval.ms`` + ``stats_cb``:
  ``brokers[*].req`` holds a counter per request type), snapshotted before and
  after each timed block;
* the control plane's requests: ``ControlPlane.requests_sent`` (what kafka2pc
  asks) and, independently, the correlation ids of kafka-python's connections
  (everything kafka-python wrote on the wire, background metadata included).

Usage::

    python benchmarks/bench_core.py                      # local broker (started or reused)
    python benchmarks/bench_core.py --bootstrap host:9092 --rounds 8 --txns 300

Prints a table and writes it to ``benchmarks/RESULTS.md``.  Timing lives here,
never in the test suite.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import confluent_kafka
from confluent_kafka import Producer

from kafka2pc import TwoPhaseCommitProducer
from kafka2pc._control import ControlPlane
from kafka2pc.testing import create_topic, drain

from _results import record_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script
STATS_INTERVAL_MS = 100


class Stats:
    """The latest librdkafka statistics of one producer, and a way to wait for a fresh one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._seq = 0
        self._requests: Counter[str] = Counter()

    def callback(self, payload: str) -> None:
        data = json.loads(payload)
        requests: Counter[str] = Counter()
        for broker in data.get("brokers", {}).values():
            for name, count in broker.get("req", {}).items():
                requests[name] += int(count)
        with self._cond:
            self._requests = requests
            self._seq += 1
            self._cond.notify_all()

    def snapshot(self, poll: Callable[[float], Any]) -> Counter[str]:
        """Cumulative requests by type, from a statistics report emitted after this call."""
        with self._cond:
            target = self._seq + 2  # the next report may have been built before the call
        deadline = time.monotonic() + 10
        while True:
            with self._cond:
                if self._seq >= target:
                    return Counter(self._requests)
            if time.monotonic() > deadline:
                raise TimeoutError("no librdkafka statistics report within 10s")
            poll(0.05)


@dataclass
class Variant:
    name: str
    run_one: Callable[[int], None]
    poll: Callable[[float], Any]
    stats: Stats
    control: ControlPlane | None = None
    rates: list[float] = field(default_factory=list)
    seconds: float = 0.0
    requests: Counter[str] = field(default_factory=Counter)
    control_requests: Counter[str] = field(default_factory=Counter)
    control_wire_requests: int = 0
    txns: int = 0


def wire_requests(control: ControlPlane) -> int:
    """Requests kafka-python has written on its open connections (their correlation ids)."""
    admin = control.session.connected_client()
    if admin is None:
        return 0
    return sum(conn.parser._correlation_id for conn in admin._manager._conns.values())  # noqa: SLF001


def build_variants(bootstrap: str, topic: str, records: int) -> tuple[Variant, Variant]:
    payload = b"x" * 100
    common = {"bootstrap.servers": bootstrap, "statistics.interval.ms": STATS_INTERVAL_MS, "linger.ms": 5}

    plain_stats = Stats()
    plain = Producer(
        {
            **common,
            "transactional.id": f"bench-plain-{uuid.uuid4().hex[:8]}",
            "stats_cb": plain_stats.callback,
            "transaction.timeout.ms": 60_000,
        }
    )
    plain.init_transactions(30)

    def plain_txn(i: int) -> None:
        plain.begin_transaction()
        for _ in range(records):
            plain.produce(topic, payload)
        plain.commit_transaction()

    tpc_stats = Stats()
    tpc = TwoPhaseCommitProducer(
        {
            **common,
            "transactional.id": f"bench-2pc-{uuid.uuid4().hex[:8]}",
            "stats_cb": tpc_stats.callback,
            "transaction.timeout.ms": 60_000,
        }
    )
    tpc.init_transactions(30)

    def tpc_txn(i: int) -> None:
        tpc.begin_transaction()
        for _ in range(records):
            tpc.produce(topic, payload)
        tpc.prepare_transaction()
        tpc.commit_transaction()

    return (
        Variant("plain confluent-kafka", plain_txn, plain.poll, plain_stats),
        Variant("TwoPhaseCommitProducer", tpc_txn, tpc.poll, tpc_stats, control=tpc.control_plane),
    )


def timed_block(variant: Variant, txns: int) -> None:
    before = variant.stats.snapshot(variant.poll)
    control_before = Counter(variant.control.requests_sent) if variant.control else Counter()
    wire_before = wire_requests(variant.control) if variant.control else 0
    started = time.perf_counter()
    for i in range(txns):
        variant.run_one(i)
    elapsed = time.perf_counter() - started
    after = variant.stats.snapshot(variant.poll)
    variant.rates.append(txns / elapsed)
    variant.seconds += elapsed
    variant.requests += after - before
    if variant.control is not None:
        variant.control_requests += Counter(variant.control.requests_sent) - control_before
        variant.control_wire_requests += wire_requests(variant.control) - wire_before
    variant.txns += txns


def per_txn(counter: Counter[str], txns: int) -> str:
    if not counter:
        return "0"
    return ", ".join(f"{name} {count / txns:.3f}" for name, count in sorted(counter.items()) if count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap", help="bootstrap servers (default: start or reuse the local broker)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per variant (interleaved)")
    parser.add_argument("--txns", type=int, default=50, help="transactions per round")
    parser.add_argument("--records", type=int, default=10, help="records per transaction")
    parser.add_argument("--warmup", type=int, default=30, help="untimed transactions per variant first")
    parser.add_argument("--no-write", action="store_true", help="do not update benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    broker_version = "external"
    bootstrap = args.bootstrap
    if bootstrap is None:
        from kafka2pc.testing.broker import LocalKafka

        kafka = LocalKafka.up()
        bootstrap, broker_version = kafka.bootstrap_servers, kafka.version
    topic = create_topic(bootstrap, partitions=1)
    plain, tpc = build_variants(bootstrap, topic, args.records)
    for variant in (plain, tpc):
        for i in range(args.warmup):
            variant.run_one(i)

    for round_no in range(args.rounds):
        order = (plain, tpc) if round_no % 2 == 0 else (tpc, plain)
        for variant in order:
            timed_block(variant, args.txns)
        print(
            f"round {round_no + 1}/{args.rounds}: plain {plain.rates[-1]:.0f} txn/s, "
            f"2pc {tpc.rates[-1]:.0f} txn/s, ratio {tpc.rates[-1] / plain.rates[-1]:.3f}",
            file=sys.stderr,
        )

    ratios = [t / p for t, p in zip(tpc.rates, plain.rates)]
    ratio = statistics.median(ratios)
    pooled = (tpc.txns / tpc.seconds) / (plain.txns / plain.seconds)
    expected = (args.warmup + args.rounds * args.txns) * args.records * 2  # both variants, same topic
    seen = len(drain(bootstrap, topic, "read_committed", timeout=120))
    assert tpc.control is not None
    control_total = sum(tpc.control_requests.values())

    lines = [
        f"`python benchmarks/bench_core.py` — {time.strftime('%Y-%m-%d %H:%M')}, Kafka {broker_version} "
        f"(single local broker), librdkafka {confluent_kafka.libversion()[0]}, confluent-kafka "
        f"{confluent_kafka.__version__}, Python {platform.python_version()}, {platform.machine()}.",
        "",
        f"{args.rounds} interleaved rounds x {args.txns} transactions x {args.records} records of 100 bytes, "
        f"one partition; after {args.warmup} warm-up transactions per variant.",
        "",
        "| variant | txn/s (median) | txn/s (min..max) | broker requests per txn (librdkafka) "
        "| control-plane requests per txn |",
        "|---|---:|---:|---|---:|",
        f"| plain confluent-kafka: begin, produce {args.records}, commit | {statistics.median(plain.rates):.0f} "
        f"| {min(plain.rates):.0f}..{max(plain.rates):.0f} | {per_txn(plain.requests, plain.txns)} | - |",
        f"| TwoPhaseCommitProducer: begin, produce {args.records}, prepare, commit "
        f"| {statistics.median(tpc.rates):.0f} | {min(tpc.rates):.0f}..{max(tpc.rates):.0f} "
        f"| {per_txn(tpc.requests, tpc.txns)} | {control_total / tpc.txns:.3f} |",
        "",
        f"**Throughput ratio 2pc / plain: {ratio:.3f}** (median of per-round ratios; "
        f"min {min(ratios):.3f}, max {max(ratios):.3f}; pooled over all rounds {pooled:.3f}; goal >= 0.95). "
        "Single rounds vary a lot on a shared 2-core machine (librdkafka retries AddPartitionsToTxn "
        "after CONCURRENT_TRANSACTIONS while the previous commit's markers are written, in both variants); "
        "the interleaving and the median are what make the ratio meaningful.",
        "",
        f"Control plane during the timed blocks: {control_total} requests counted by "
        f"`ControlPlane.requests_sent` ({dict(tpc.control_requests) or 'none'}), "
        f"{tpc.control_wire_requests} written on kafka-python's connections (correlation ids, "
        "background metadata refresh included). Goal: 0 per transaction.",
        "",
        f"Records visible to read_committed at the end: {seen} of {expected} produced.",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_write:
        record_section("Core: TwoPhaseCommitProducer vs plain confluent-kafka", report)
    return 0 if seen == expected else 1


if __name__ == "__main__":
    sys.exit(main())
