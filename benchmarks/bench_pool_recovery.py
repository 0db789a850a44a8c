"""How fast does one surviving instance settle the ids a killed WriterPool instance left in doubt?

Setup: child processes (``--child``) each run a :class:`WriterPool` with one
slot per thread; every thread runs one transaction (a row and a record) and
stops at a step, where the child is killed with SIGKILL:

* half of them after the database COMMIT (``db_committed``): recovery must
  **commit** the prepared Kafka transaction;
* half after the prepare (``prepared``): the database has not committed,
  recovery must **abort**.

Then one instance (``WriterPool.settle_orphans``, as its background scan
does once the leases expired) settles every id, ``settle_parallelism`` at a
time.  Reported: ids, the wall time to settle all of them, ids per second,
the decisions, and a check of the result (every id closed in Kafka, every
committed row has exactly one ``read_committed`` record and vice versa).

Run::

    python benchmarks/bench_pool_recovery.py [--ids 1000] [--scaling 200] [--parallelism 1,4,16]

Kafka: ``$KAFKA_BOOTSTRAP_SERVERS`` or the local broker (started if needed).
PostgreSQL: ``$KAFKA2PC_PG_ADMIN_URL`` (a fresh database is created and dropped).
Results are printed and recorded under "## Writer pool: orphan recovery" in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa
from kafka2pc.recipes.dual_write import Step, WriterPool, define_lease_table, define_state_table

from kafka2pc import TransactionAdmin
from kafka2pc.testing import create_topic, drain, end_offsets
from kafka2pc.testing.postgres import fresh_database

from _results import record_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HEADING = "Writer pool: orphan recovery"
PER_CHILD = 25


def _items(metadata: sa.MetaData) -> sa.Table:
    return sa.Table("bench_items", metadata, sa.Column("id", sa.String(100), primary_key=True))


def _bootstrap() -> str:
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    from kafka2pc.testing.broker import LocalKafka

    return LocalKafka.up().bootstrap_servers


def child(job: dict[str, Any]) -> None:
    """Lease ``job["n"]`` ids, run one transaction on each, stop every thread at its step; the parent kills us."""
    logging.basicConfig(level=logging.ERROR)
    engine = sa.create_engine(job["url"], pool_size=job["n"] + 8, max_overflow=20)
    items = _items(sa.MetaData())
    parked = threading.Semaphore(0)
    where = threading.local()

    def hook(step: Step) -> None:
        if step.value == getattr(where, "park_at", None):
            parked.release()
            threading.Event().wait()

    # A long lease: the ids of the children killed before this one are not expired yet, so this one takes
    # only free ids (the parent expires every lease at the end, as if a lease interval had passed).
    pool = WriterPool(engine, {"bootstrap.servers": job["bootstrap"]}, prefix=job["prefix"], size=job["size"],
                      max_slots=job["n"], lease_s=3600, on_step=hook, acquire_timeout_s=300,
                      state_table=define_state_table(sa.MetaData()), scan_every_s=3600)

    def one(i: int) -> None:
        where.park_at = "db_committed" if i % 2 == 0 else "prepared"
        rid = f"{job['prefix']}:{job['child']}:{i}"
        try:
            with engine.connect() as conn, pool.transaction(conn) as tx:
                tx.produce(job["topic"], value=rid.encode())
                conn.execute(items.insert().values(id=rid))
        except BaseException as exc:  # noqa: BLE001 - the parent sees the child end
            sys.stderr.write(f"transaction {i} failed: {exc!r}\n")
            sys.stderr.flush()
            os._exit(3)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(job["n"])]
    for t in threads:
        t.start()
    for _ in threads:
        parked.acquire()
    sys.stdout.write("parked\n")
    sys.stdout.flush()
    threading.Event().wait()


def pin_child(job: dict[str, Any]) -> None:
    """One instance with the default lease: a transaction whose records reached Kafka, stopped; we get killed."""
    logging.basicConfig(level=logging.ERROR)
    engine = sa.create_engine(job["url"])
    items = _items(sa.MetaData())

    def hook(step: Step) -> None:
        if step is Step.PRODUCED:
            time.sleep(0.3)  # the record reaches the broker: the transaction is Ongoing
            sys.stdout.write("parked\n")
            sys.stdout.flush()
            threading.Event().wait()

    pool = WriterPool(engine, {"bootstrap.servers": job["bootstrap"]}, prefix=job["prefix"], size=job["size"],
                      max_slots=1, on_step=hook, state_table=define_state_table(sa.MetaData()))
    rid = f"{job['prefix']}:pinned"
    with engine.connect() as conn, pool.transaction(conn) as tx:
        tx.produce(job["topic"], value=rid.encode())
        conn.execute(items.insert().values(id=rid))


def measure_pin(url: str, bootstrap: str, runs: int) -> list[float]:
    """Seconds from the SIGKILL of an instance (right after it renewed its lease: the worst moment) until its
    open transaction is settled by a surviving instance, with the default lease (15 s) and scan (lease / 3)."""
    engine = sa.create_engine(url)
    leases = define_lease_table(sa.MetaData())
    pins = []
    for run_no in range(runs):
        prefix = f"pin-{uuid.uuid4().hex[:6]}"
        topic = create_topic(bootstrap)
        survivor = WriterPool(engine, {"bootstrap.servers": bootstrap}, prefix=prefix, size=4, max_slots=1,
                              state_table=define_state_table(sa.MetaData()))
        job = {"url": url, "bootstrap": bootstrap, "topic": topic, "prefix": prefix, "size": 4}
        proc = subprocess.Popen([sys.executable, __file__, "--pin-child", json.dumps(job)], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "parked":
            proc.kill()
            raise RuntimeError("the pinning instance did not start its transaction")
        with engine.connect() as conn:
            (tid, expires) = conn.execute(sa.select(leases.c.transactional_id, leases.c.expires_at)
                                          .where(leases.c.pool == prefix, leases.c.owner.is_not(None))).one()
            while True:  # kill right after a renewal: the lease then runs longest
                conn.rollback()
                now_expires = conn.execute(sa.select(leases.c.expires_at)
                                           .where(leases.c.transactional_id == tid)).scalar_one()
                if now_expires != expires:
                    break
                time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
        with TransactionAdmin({"bootstrap.servers": bootstrap}) as admin:
            while (info := admin.describe_transaction(tid)) is not None and info.is_open:
                time.sleep(0.05)
        pins.append(time.monotonic() - killed)
        print(json.dumps({"pin_run": run_no, "seconds": pins[-1]}), flush=True)
        survivor.close()
    engine.dispose()
    return pins


def leave_in_doubt(url: str, bootstrap: str, topic: str, prefix: str, ids: int) -> float:
    """Children leave ``ids`` transactions in doubt under ``prefix``; the seconds that took."""
    began = time.monotonic()
    for c in range(0, ids, PER_CHILD):
        n = min(PER_CHILD, ids - c)
        job = {"url": url, "bootstrap": bootstrap, "topic": topic, "prefix": prefix, "size": ids, "n": n,
               "child": c // PER_CHILD}
        proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(job)], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "parked":
            proc.kill()
            raise RuntimeError(f"child {c // PER_CHILD} did not park its transactions ({line!r})")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return time.monotonic() - began


def settle(url: str, bootstrap: str, topic: str, prefix: str, ids: int, parallelism: int) -> dict[str, Any]:
    engine = sa.create_engine(url, pool_size=parallelism + 4, max_overflow=parallelism)
    leases = define_lease_table(sa.MetaData())
    with engine.begin() as conn:  # a lease interval has passed since the kills
        conn.execute(sa.update(leases).where(leases.c.pool == prefix)
                     .values(expires_at=datetime.now(timezone.utc).replace(tzinfo=None) - timedelta(seconds=1)))
    pool = WriterPool(engine, {"bootstrap.servers": bootstrap}, prefix=prefix, size=ids, max_slots=1,
                      lease_s=30, settle_parallelism=parallelism, start=False,
                      state_table=define_state_table(sa.MetaData()))
    began = time.monotonic()
    results = pool.settle_orphans()
    elapsed = time.monotonic() - began
    pool.close()
    decisions = Counter(r.settlement.plan.decision.value if r.settlement else f"error:{r.error!r}" for r in results)
    problems = _check(engine, bootstrap, topic, prefix, ids)
    engine.dispose()
    return {"ids": ids, "parallelism": parallelism, "seconds": elapsed, "per_s": len(results) / elapsed,
            "decisions": dict(decisions), "settled": len(results), "problems": problems}


def _check(engine: sa.Engine, bootstrap: str, topic: str, prefix: str, ids: int) -> list[str]:
    problems = []
    with TransactionAdmin({"bootstrap.servers": bootstrap}) as admin:
        still_open = [f"{prefix}-{i}" for i in range(ids)
                      if (info := admin.describe_transaction(f"{prefix}-{i}")) is not None and info.is_open]
    if still_open:
        problems.append(f"{len(still_open)} still open")
    items = _items(sa.MetaData())
    with engine.connect() as conn:
        rows = set(conn.execute(sa.select(items.c.id).where(items.c.id.like(f"{prefix}:%"))).scalars())
    records = Counter(r.value.decode() for r in drain(bootstrap, topic, "read_committed") if r.value)
    if any(n > 1 for n in records.values()):
        problems.append("duplicates")
    if rows != set(records):
        problems.append(f"rows != records ({len(rows)} vs {len(records)})")
    expected = sum((min(PER_CHILD, ids - c) + 1) // 2 for c in range(0, ids, PER_CHILD))  # even threads commit
    if len(rows) != expected:
        problems.append(f"{len(rows)} rows committed, expected {expected}")
    if end_offsets(bootstrap, topic, "read_committed") != end_offsets(bootstrap, topic, "read_uncommitted"):
        problems.append("read_committed end offset != read_uncommitted end offset")
    return problems


def run(ids: int, scaling: int, parallelisms: list[int], pin_runs: int) -> tuple[list[dict[str, Any]], list[float]]:
    bootstrap = _bootstrap()
    out = []
    with fresh_database() as url:
        engine = sa.create_engine(url)
        metadata = sa.MetaData()
        define_state_table(metadata)
        define_lease_table(metadata)
        _items(metadata)
        metadata.create_all(engine)
        engine.dispose()
        plan = [(scaling, p) for p in parallelisms] + [(ids, max(parallelisms))]
        for n, p in plan:
            prefix = f"rec-{uuid.uuid4().hex[:6]}-{n}-{p}"
            topic = create_topic(bootstrap, partitions=3)
            setup_s = leave_in_doubt(url, bootstrap, topic, prefix, n)
            result = settle(url, bootstrap, topic, prefix, n, p)
            result["setup_s"] = setup_s
            print(json.dumps(result), flush=True)
            out.append(result)
        pins = measure_pin(url, bootstrap, pin_runs) if pin_runs else []
    return out, pins


def _table(results: list[dict[str, Any]]) -> str:
    lines = ["| ids in doubt | settle_parallelism | seconds to settle all | ids/s | decisions | check |",
             "|---:|---:|---:|---:|---|---|"]
    for r in results:
        decisions = ", ".join(f"{k} {v}" for k, v in sorted(r["decisions"].items()))
        check = "I1-I5 hold, nothing open" if not r["problems"] else "; ".join(r["problems"])
        lines.append(f"| {r['ids']} | {r['parallelism']} | {r['seconds']:.2f} | {r['per_s']:.0f} | {decisions} "
                     f"| {check} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=1000)
    parser.add_argument("--scaling", type=int, default=200, help="ids per run of the parallelism sweep")
    parser.add_argument("--parallelism", default="1,4,16")
    parser.add_argument("--pin-runs", type=int, default=3, help="kills measuring how long consumers are held back")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--pin-child", help=argparse.SUPPRESS)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.pin_child:
        pin_child(json.loads(args.pin_child))
        return
    results, pins = run(args.ids, args.scaling, [int(p) for p in args.parallelism.split(",")], args.pin_runs)
    table = _table(results)
    pinned = (
        f"Held back by a killed instance (default lease 15 s, scan every 5 s +-20 %; killed right after it renewed "
        f"its lease, one transaction Ongoing; until a surviving instance settled it): {len(pins)} runs, "
        f"max {max(pins):.1f} s, min {min(pins):.1f} s (bound: lease + 1.2 x scan + recovery = 21 s + recovery).\n"
        if pins else ""
    )
    print(table)
    print(pinned)
    if not args.no_record:
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        record_section(HEADING, (
            "`python benchmarks/bench_pool_recovery.py`: transactions left in doubt by SIGKILLed `WriterPool` "
            f"instances ({PER_CHILD} ids per process, each with one transaction stopped either after its database "
            "COMMIT, to be committed, or after its prepare, to be aborted), settled by one surviving instance "
            "(`settle_orphans()`, what its background scan runs once the leases expired). Each row is a fresh set "
            "of ids.\n\n"
            f"{table}\n\n{pinned}\n"
            f"Measured {when} on {platform.machine()}, {os.cpu_count()} CPUs (load average "
            f"{os.getloadavg()[0]:.1f} at the end), Python {platform.python_version()}, local single-node Kafka and "
            "PostgreSQL on the same machine.\n"
        ))
        print("recorded in benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
