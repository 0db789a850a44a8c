"""Pipelined commit (``WriterPool(pipelined=True)``): order per partition, read-your-writes, drain, kill -9.

The crash run kills instances with SIGKILL while background Kafka commits are
in flight (a timer fired up to a few milliseconds after a database COMMIT
waits until the pool reports a commit in flight, then kills), then checks
I1-I5 with a ``read_committed`` consumer and the database, and that recovery
settled every pooled id.  ``KAFKA2PC_PIPELINE_CRASH_RUNS`` sizes it (default 6
per database, drawn from the test's seed, ``$KAFKA2PC_SEED``; the campaign
marker's test runs 200).  Every transaction whose block returned (acknowledged
once the database committed; its Kafka commit runs in the background) is in the
instances' fsynced acknowledged-write log (``harness.acks``), and must be a row
and exactly one ``read_committed`` record after the recovery.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer
from harness.acks import AckLog
from harness.dw_crash import check_consistency, items_table
from harness.pool import pool_engine, pool_prefix
from harness.procs import child_env
from kafka2pc.recipes.dual_write import WriterPool

from kafka2pc import TransactionAdmin
from kafka2pc.testing import create_topic, end_offsets

WORKER = Path(__file__).with_name("_pool_worker.py")
CRASH_RUNS = int(os.environ.get("KAFKA2PC_PIPELINE_CRASH_RUNS", "6"))
#: Seeds the kill schedule (which transaction, how long after its COMMIT); printed with the summary.
#: How long a kill waits for a commit in flight (one is within milliseconds while three threads write).
IN_FLIGHT_WAIT_S = 10.0
LEASE_S = 1.0


def _engine(url: str) -> sa.Engine:
    return pool_engine(url, pool_size=10)


def _prefix(name: str) -> str:
    return pool_prefix("pipe", name)


def test_pipelined_transactions_keep_the_order_per_partition(pg_url: str, kafka_bootstrap: str) -> None:
    """One thread, 150 pipelined transactions over 4 slots: a live read_committed consumer sees each key's
    records in the order they were written, although their Kafka commits overlap."""
    engine = _engine(pg_url)
    topic = create_topic(kafka_bootstrap, partitions=2)
    prefix = _prefix("order")
    items = items_table(sa.MetaData())
    pool = WriterPool(engine, {"bootstrap.servers": kafka_bootstrap}, prefix=prefix, size=4, max_slots=4,
                      pipelined=True, lease_s=5)
    seen: dict[str, list[int]] = defaultdict(list)
    stop = threading.Event()

    def consume() -> None:
        consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": prefix,
                             "isolation.level": "read_committed", "auto.offset.reset": "earliest",
                             "enable.auto.commit": False})
        consumer.subscribe([topic])
        try:
            while not stop.is_set() or sum(map(len, seen.values())) < 300:
                msg = consumer.poll(0.2)
                if msg is not None and not msg.error():
                    seen[msg.key().decode()].append(int(msg.value().decode().split(":")[-1]))
        finally:
            consumer.close()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    most_in_flight = 0
    try:
        with engine.connect() as conn:
            for n in range(150):
                with pool.transaction(conn) as tx:
                    for key in ("a", "b"):  # two keys, usually two partitions
                        tx.produce(topic, key=key.encode(), value=f"{prefix}:{key}:{n}".encode())
                    conn.execute(items.insert(), [{"id": f"{prefix}:{k}:{n}", "series": prefix} for k in "ab"])
                most_in_flight = max(most_in_flight, pool.metrics().commits_in_flight)
        pool.wait_visible(30)
    finally:
        stop.set()
        reader.join(60)
        used = len(pool.held_ids)
        pool.close()
    assert seen["a"] == list(range(150)) and seen["b"] == list(range(150)), {k: v[:10] for k, v in seen.items()}
    assert used > 1 and most_in_flight >= 1, "the commits never overlapped: nothing was pipelined"
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, prefix)
    assert not problems and rows == records == 300
    engine.dispose()


def test_wait_visible_gives_read_your_writes(db_url: str, kafka_bootstrap: str) -> None:
    engine = _engine(db_url)
    topic = create_topic(kafka_bootstrap)
    prefix = _prefix("ryw")
    items = items_table(sa.MetaData())
    pool = WriterPool(engine, {"bootstrap.servers": kafka_bootstrap}, prefix=prefix, size=3, max_slots=3,
                      pipelined=True, lease_s=5)
    try:
        with engine.connect() as conn:
            with pool.transaction(conn, wait_visible=True) as tx:
                tx.produce(topic, value=f"{prefix}:0".encode())
                conn.execute(items.insert().values(id=f"{prefix}:0", series=prefix))
            assert end_offsets(kafka_bootstrap, topic, "read_committed") == \
                end_offsets(kafka_bootstrap, topic, "read_uncommitted")
            for n in range(1, 6):
                with pool.transaction(conn) as tx:
                    tx.produce(topic, value=f"{prefix}:{n}".encode())
                    conn.execute(items.insert().values(id=f"{prefix}:{n}", series=prefix))
            pool.wait_visible(30)
            assert pool.metrics().commits_in_flight == 0
            assert end_offsets(kafka_bootstrap, topic, "read_committed") == \
                end_offsets(kafka_bootstrap, topic, "read_uncommitted")
    finally:
        pool.close()
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, prefix)
    assert not problems and rows == records == 6
    engine.dispose()


def test_close_drains_the_commits_in_flight(pg_url: str, kafka_bootstrap: str) -> None:
    engine = _engine(pg_url)
    topic = create_topic(kafka_bootstrap)
    prefix = _prefix("drain")
    items = items_table(sa.MetaData())
    pool = WriterPool(engine, {"bootstrap.servers": kafka_bootstrap}, prefix=prefix, size=4, max_slots=4,
                      pipelined=True, lease_s=5, slow_commit_s=0.0)
    with engine.connect() as conn:
        for n in range(20):
            with pool.transaction(conn) as tx:
                tx.produce(topic, value=f"{prefix}:{n}".encode())
                conn.execute(items.insert().values(id=f"{prefix}:{n}", series=prefix))
    pool.close()
    assert pool.metrics().commits_in_flight == 0
    assert pool.metrics().slow_commits == 20  # slow_commit_s=0: every commit is reported slow (and logged)
    assert all(lease.owner is None for lease in pool.leases())  # all committed: released
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, prefix)
    assert not problems and rows == records == 20
    engine.dispose()


def _crash_runs(url: str, bootstrap: str, tmp_path: Path, runs: int, label: str, seed: int) -> dict[str, Any]:
    """``runs`` pipelined instances one after the other on one pool, each SIGKILLed with commits in flight."""
    engine = _engine(url)
    topic = create_topic(bootstrap, partitions=2)
    prefix = _prefix(f"crash-{label}")
    results = tmp_path / f"{prefix}.jsonl"
    rng = random.Random(seed)
    acks = AckLog(tmp_path / f"{prefix}.acks")
    outcomes: dict[str, int] = defaultdict(int)
    try:
        for run in range(runs):
            job = {
                "db_url": url, "bootstrap": bootstrap, "prefix": prefix, "size": 10, "threads": 3, "max_slots": 4,
                "lease_s": LEASE_S, "topic": topic, "series": prefix, "worker": f"r{run}", "results": str(results),
                "ack_log": str(acks.path),
                "pipelined": True, "kill_at": "db_committed", "after": rng.randrange(1, 6), "kill_within_s": 0.002,
                "in_flight_wait_s": IN_FLIGHT_WAIT_S,
                "seed": rng.randrange(1 << 30),
            }
            proc = subprocess.Popen([sys.executable, str(WORKER), json.dumps(job)], env=child_env(),
                                    stderr=open(tmp_path / f"{prefix}-r{run}.log", "wb"))  # noqa: SIM115
            try:
                code = proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                raise AssertionError(f"run {run} did not die within 90 s") from None
            outcomes["killed" if code == -9 else f"exit {code}"] += 1
        lines = [json.loads(line) for line in results.read_text().splitlines()]
        in_flight = [e["in_flight"] for e in lines if e.get("fault") == "timer"]
        time.sleep(LEASE_S + 0.2)
        last = WriterPool(engine, {"bootstrap.servers": bootstrap}, prefix=prefix, size=10, lease_s=5, start=False)
        try:
            final = last.settle_orphans()
        finally:
            last.close()
        assert all(r.error is None for r in final), [r.error for r in final]
        # Acknowledged (fsynced by the instances): a row and exactly one read_committed record each.
        rows, records, problems = check_consistency(engine, bootstrap, topic, prefix, acks)
        acked = set(acks.ids())
        if not {e["ok"] for e in lines if "ok" in e} <= acked:  # logged first: a kill may fall between the two
            problems.append("an id in the results is missing from the acknowledged-write log")
        with TransactionAdmin({"bootstrap.servers": bootstrap}) as admin:
            still_open = [f"{prefix}-{i}" for i in range(10)
                          if (info := admin.describe_transaction(f"{prefix}-{i}")) is not None and info.is_open]
        if still_open:
            problems.append(f"still open after recovery: {still_open}")
        errors = sorted({e["error"] for e in lines if "error" in e})
        summary = {"runs": runs, "seed": seed, **outcomes, "kills_with_commits_in_flight": sum(n > 0 for n in in_flight),
                   "rows": rows, "records": records, "acked": len(acked), "errors": errors,
                   "final_settled": len(final)}
        print(f"\npipelined crash runs on {label}: {summary}")
        assert not problems, problems
        assert outcomes["killed"] == runs, outcomes
        assert rows == records
        assert len(in_flight) == runs, f"{len(in_flight)} of {runs} kills came from the timer"
        assert all(n > 0 for n in in_flight), f"kills without a commit in flight: {in_flight}"
        return summary
    finally:
        engine.dispose()


def test_kill_9_with_pipelined_commits_in_flight(
    db_url: str, kafka_bootstrap: str, tmp_path: Path, seed: int
) -> None:
    label = "pg" if db_url.startswith("postgresql") else "sqlite"
    _crash_runs(db_url, kafka_bootstrap, tmp_path, CRASH_RUNS, label, seed)


@pytest.mark.campaign
@pytest.mark.timeout(3 * 3600)
def test_kill_9_with_pipelined_commits_in_flight_campaign(
    db_url: str, kafka_bootstrap: str, tmp_path: Path, seed: int
) -> None:
    runs = int(os.environ.get("KAFKA2PC_PIPELINE_CAMPAIGN_RUNS", "200"))
    _crash_runs(db_url, kafka_bootstrap, tmp_path, runs, "pg" if db_url.startswith("postgresql") else "sqlite", seed)
