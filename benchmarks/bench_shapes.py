"""What does an exact name cost for each transaction shape?  Offsets-only and empty vs record transactions.

Four variants run against the same broker in the same process, rounds
interleaved (the order rotates every round) so that drifts in machine load hit
all alike:

* **records**: ``TwoPhaseCommitProducer``: begin -> produce 1 -> prepare -> commit
  (anchored on its record: no extra round trip; the baseline);
* **offsets**: ``TwoPhaseCommitProducer``: begin -> send_offsets_to_transaction ->
  prepare (writes the marker record) -> commit;
* **plain offsets**: ``confluent_kafka.Producer``: begin -> send_offsets_to_transaction
  -> commit (the same work without kafka2pc: what the marker adds on top);
* **empty**: ``TwoPhaseCommitProducer``: begin -> prepare -> commit (nothing sent).

Reported: the median time per transaction of each variant and the median of
the per-round ratios against **records** and, for offsets, against
**plain offsets**.

Usage::

    python benchmarks/bench_shapes.py                     # local broker (started or reused)
    python benchmarks/bench_shapes.py --bootstrap host:9092 --rounds 6 --txns 100

Prints a table and writes it to ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import uuid
from collections.abc import Callable

import confluent_kafka
from confluent_kafka import Consumer, Producer, TopicPartition

from kafka2pc import TwoPhaseCommitProducer
from kafka2pc.testing import create_topic

from _results import record_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script


def build(bootstrap: str, topic: str) -> dict[str, Callable[[int], None]]:
    common = {"bootstrap.servers": bootstrap, "linger.ms": 5, "transaction.timeout.ms": 60_000}
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-shapes-{uuid.uuid4().hex[:8]}"})
    meta = consumer.consumer_group_metadata()

    def tpc() -> TwoPhaseCommitProducer:
        p = TwoPhaseCommitProducer({**common, "transactional.id": f"bench-shape-{uuid.uuid4().hex[:8]}"})
        p.init_transactions(30)
        return p

    records_p, offsets_p, empty_p = tpc(), tpc(), tpc()
    plain = Producer({**common, "transactional.id": f"bench-plain-{uuid.uuid4().hex[:8]}"})
    plain.init_transactions(30)

    def records(i: int) -> None:
        records_p.begin_transaction()
        records_p.produce(topic, b"x" * 100)
        records_p.prepare_transaction()
        records_p.commit_transaction()

    def offsets(i: int) -> None:
        offsets_p.begin_transaction()
        offsets_p.send_offsets_to_transaction([TopicPartition(topic, 0, i + 1)], meta)
        offsets_p.prepare_transaction()
        offsets_p.commit_transaction()

    def plain_offsets(i: int) -> None:
        plain.begin_transaction()
        plain.send_offsets_to_transaction([TopicPartition(topic, 1, i + 1)], meta)
        plain.commit_transaction()

    def empty(i: int) -> None:
        empty_p.begin_transaction()
        empty_p.prepare_transaction()
        empty_p.commit_transaction()

    return {"records": records, "offsets": offsets, "plain offsets": plain_offsets, "empty": empty}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--txns", type=int, default=100)
    parser.add_argument("--no-record", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = parser.parse_args()
    bootstrap = args.bootstrap
    if bootstrap is None:
        from kafka2pc.testing.broker import LocalKafka

        bootstrap = LocalKafka.up().bootstrap_servers
    topic = create_topic(bootstrap, partitions=2)
    variants = build(bootstrap, topic)
    for fn in variants.values():  # warm-up: connections, anchor topic lookup/creation
        for i in range(5):
            fn(i)
    per_txn: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    counter = 100
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            for _ in range(args.txns):
                counter += 1
                variants[name](counter)
            per_txn[name].append((time.perf_counter() - start) / args.txns * 1000)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(per_txn[a], per_txn[b]))

    lines = [
        f"{args.rounds} interleaved rounds x {args.txns} transactions per variant; confluent-kafka "
        f"{confluent_kafka.version()} / librdkafka {confluent_kafka.libversion()[0]}, Python "
        f"{platform.python_version()}, broker {bootstrap} (local, single node).",
        "",
        "| variant | ms / transaction (median of rounds) | vs records | vs plain offsets |",
        "|---|---|---|---|",
    ]
    for name in names:
        vs_plain = f"{ratio(name, 'plain offsets'):.2f}x" if name in ("offsets", "plain offsets") else ""
        lines.append(
            f"| {name} | {statistics.median(per_txn[name]):.2f} | {ratio(name, 'records'):.2f}x | {vs_plain} |"
        )
    lines += [
        "",
        "records: 1 record, anchored on it (no extra round trip). offsets: `send_offsets_to_transaction` only; "
        "prepare writes the marker record to `kafka2pc-anchors` (AddPartitionsToTxn + Produce). "
        "plain offsets: the same with a bare `confluent_kafka.Producer` (no marker). "
        "empty: nothing sent (no broker request at all).",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_record:
        record_section("Transaction shapes (bench_shapes.py)", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
