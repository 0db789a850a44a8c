"""Where the client CPU of a dual write goes: cProfile of every thread, per transaction, on PostgreSQL.

Runs one variant of ``bench_dual_write.py`` (``pipelined``: ``WriterPool(pipelined=True)``;
``bound``: the 2PC bound, the protocol over plain producers with no state row) with ``W``
writer threads for a few seconds, and prints:

* the client CPU per transaction without the profiler (``time.process_time()``, every thread),
* the statements the client sent per transaction (SQLAlchemy's ``before_cursor_execute``,
  counted in a separate unprofiled run, since a listener changes the recipe's path),
* with ``--profile``, the top functions of all threads merged (cProfile in every thread
  started after the profiler was set up, including the pool's commit workers), in
  milliseconds per transaction.  cProfile inflates Python-heavy code: read the shares, not
  the totals.  The timer is each thread's CPU time (``time.thread_time``), not the wall clock.

Run::

    python benchmarks/profile_dual_write.py --mode pipelined --writers 1 --seconds 5 --profile
    python benchmarks/profile_dual_write.py --mode bound --writers 4 --profile --sort tottime

Kafka: ``$KAFKA_BOOTSTRAP_SERVERS`` or the local broker (started if needed).
PostgreSQL: ``$KAFKA2PC_PG_ADMIN_URL`` (a fresh database is created and dropped).  Prints only;
records nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import re
import threading
import time
import uuid
from typing import Any

import sqlalchemy as sa
from _results import merged_profile  # noqa: E402 - benchmarks/ is on sys.path
from bench_dual_write import Lane, _bootstrap, _measure  # noqa: E402 - benchmarks/ is on sys.path
from kafka2pc.recipes.dual_write import WriterPool, define_lease_table, define_state_table

from kafka2pc.testing import create_topic
from kafka2pc.testing.postgres import fresh_database


def _count_statements(engine: sa.Engine) -> tuple[dict[str, int], Any]:
    counts: dict[str, int] = {}

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        key = re.sub(r"'[^']*'", "?", " ".join(statement.split()))[:100]
        counts[key] = counts.get(key, 0) + 1

    sa.event.listen(engine, "before_cursor_execute", count)
    return counts, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("pipelined", "bound", "baseline", "recipe"), default="pipelined")
    parser.add_argument("--writers", type=int, default=1, help="writer threads (one transactional id each)")
    parser.add_argument("--records", type=int, default=1, help="records (and rows) per transaction")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each measured run")
    parser.add_argument("--profile", action="store_true", help="also run under cProfile and print the top entries")
    parser.add_argument("--sort", default="cumulative", help="pstats sort key (cumulative, tottime)")
    parser.add_argument("--top", type=int, default=40, help="entries printed")
    parser.add_argument("--dump", help="also write the merged profile to this file (pstats format)")
    args = parser.parse_args()

    bootstrap, _ = _bootstrap()
    with fresh_database() as url:
        engine = sa.create_engine(url, pool_size=2 * args.writers + 2)
        metadata = sa.MetaData()
        define_state_table(metadata)
        define_lease_table(metadata)
        orders = sa.Table("bench_orders", metadata, sa.Column("id", sa.String(80), primary_key=True),
                          sa.Column("payload", sa.String(200)))
        metadata.create_all(engine)
        topic = create_topic(bootstrap, partitions=3)
        run_id = uuid.uuid4().hex[:8]
        profiles: list[cProfile.Profile] = []
        lock = threading.Lock()

        def start_profile(*_: object) -> None:  # the first event of each new thread: profile it from there
            profile = cProfile.Profile(time.thread_time)
            with lock:
                profiles.append(profile)
            profile.enable()

        if args.profile:  # every thread started from here on is profiled (the pool's workers too)
            threading.setprofile(start_profile)
        pool = WriterPool(engine, {"bootstrap.servers": bootstrap}, prefix=f"prof-{run_id}", size=2 * args.writers,
                          max_slots=2 * args.writers, pipelined=True, state_table=define_state_table(sa.MetaData()))
        lanes = [Lane(engine, bootstrap, f"{run_id}-{i}", pool) for i in range(args.writers)]
        _measure(lanes, args.mode, orders, topic, args.records, 1.0, f"{run_id}-warm")

        if not args.profile:
            started = time.process_time()
            rate = _measure(lanes, args.mode, orders, topic, args.records, args.seconds, f"{run_id}-plain")
            used = time.process_time() - started
            print(f"{args.mode}, {args.writers} writers, {args.records} records: {rate:.1f} txn/s, "
                  f"client CPU {1000 * used / max(rate * args.seconds, 1):.3f} ms/txn (no profiler)")
            counts, listener = _count_statements(engine)
            rate_counted = _measure(lanes, args.mode, orders, topic, args.records, 2.0, f"{run_id}-count")
            sa.event.remove(engine, "before_cursor_execute", listener)
            txns = rate_counted * 2.0
            print(f"statements per transaction (client side, {txns:.0f} txns; a listener sends the combined "
                  "state update through SQLAlchemy, so it shows here):")
            for statement, n in sorted(counts.items(), key=lambda kv: -kv[1]):
                print(f"  {n / txns:6.2f}  {statement}")
        else:
            with lock:
                for p in profiles:
                    p.clear()  # forget the start and the warm-up
            main_profile = cProfile.Profile(time.thread_time)
            main_profile.enable()
            prate = _measure(lanes, args.mode, orders, topic, args.records, args.seconds, f"{run_id}-prof")
            main_profile.disable()
            threading.setprofile(None)  # type: ignore[arg-type]
            ptxns = prate * args.seconds
            with lock:
                taken = list(profiles)
            report = merged_profile([main_profile, *taken], args.sort, args.top, args.dump)
            print(f"profiled: {prate:.1f} txn/s over {len(taken) + 1} threads, {ptxns:.0f} txns; "
                  f"times below are seconds over the run: divide by {ptxns:.0f} for per-txn")
            print(report)
        pool.close()
        for lane in lanes:
            lane.close()
        engine.dispose()


if __name__ == "__main__":
    main()
