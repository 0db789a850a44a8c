"""A service instance for the writer-pool tests: a WriterPool and threads writing through it, until killed.

Run as ``python _pool_worker.py '<job json>'``.  Each thread runs
transactions (one row and one record per id, ``<series>:<worker>:<thread>:<n>``)
and appends every id whose ``with`` block returned to ``job["results"]``
(acknowledged to the application: the database committed it) and, fsynced, to
the acknowledged-write log ``job["ack_log"]`` (``harness.acks``), if given.  Errors are
appended too.  The parent kills the process (SIGKILL), pauses it
(SIGSTOP/SIGCONT) or ends it with SIGTERM (clean close of the pool).

Fault points (``on_step``): ``kill_at`` kills the process at that step of
the ``after``-th transaction; ``stop_at`` stops it there (SIGSTOP) once;
``fault_when_open`` makes either wait until the transaction's records are on
the broker (only one transaction may be open: one thread, not pipelined);
``park_at`` makes every thread block forever at that step (the recovery
benchmark leaves many ids in doubt this way, then kills the process).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from typing import Any

import sqlalchemy as sa
from harness.acks import AckLog  # tests/ is on its PYTHONPATH (harness.procs)
from harness.dw_crash import append_record, items_table


def main(job: dict[str, Any]) -> None:
    import logging

    from kafka2pc.recipes.dual_write import Step, WriterPool, define_state_table

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {job['worker']} %(threadName)s %(levelname)s %(name)s: %(message)s")
    connect_args = {"timeout": 30} if job["db_url"].startswith("sqlite") else {}
    engine = sa.create_engine(job["db_url"], pool_size=2 * job["threads"] + 4, connect_args=connect_args)
    items = items_table(sa.MetaData())
    results = job["results"]
    done = threading.Event()
    started = {"n": 0}
    lock = threading.Lock()
    fault = {"fired": False}
    current = threading.local()
    rng = random.Random(job.get("seed", 0))
    acks = AckLog(job["ack_log"]) if job.get("ack_log") else AckLog.from_env()

    def hook(step: Step) -> None:
        if job.get("park_at") == step.value:
            with lock:
                started["n"] += 1
                parked = started["n"]
            append_record(results, {"worker": job["worker"], "parked": parked, "step": step.value})
            threading.Event().wait()  # until the process is killed
        for key in ("kill_at", "stop_at"):
            if job.get(key) != step.value:
                continue
            with lock:
                if fault["fired"] or started["n"] < job.get("after", 0):
                    return
                fault["fired"] = True
            if job.get("kill_within_s") is not None:
                # Kill from another thread a moment later, once a pipelined Kafka commit (this
                # transaction's is handed off right after this step) is in flight: within
                # ``in_flight_wait_s`` it is; the record says how many were when the kill was sent.
                def later() -> None:
                    deadline = time.monotonic() + job.get("in_flight_wait_s", 0.0)
                    while pool.metrics().commits_in_flight == 0 and time.monotonic() < deadline:
                        time.sleep(0.0001)
                    append_record(results, {"worker": job["worker"], "fault": "timer", "step": step.value,
                                      "in_flight": pool.metrics().commits_in_flight, "t": time.time()})
                    os.kill(os.getpid(), signal.SIGKILL)

                threading.Timer(rng.uniform(0.0, job["kill_within_s"]), later).start()
                return
            if job.get("fault_when_open"):
                # Once librdkafka sent the records: the transaction is Ongoing at the broker.
                from kafka2pc.testing import wait_for_open_records

                wait_for_open_records(job["bootstrap"], job["topic"])
            append_record(results, {"worker": job["worker"], "fault": key, "step": step.value, "pid": os.getpid(),
                              "rid": getattr(current, "rid", None), "t": time.time()})
            if key == "kill_at":
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                # Thread-directed: a process-directed SIGSTOP may be taken by another thread, and this
                # one ran on meanwhile (seen: past the database COMMIT) before the whole process stopped.
                signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    pool = WriterPool(
        engine, {"bootstrap.servers": job["bootstrap"], **job.get("producer_config", {})},
        prefix=job["prefix"], size=job["size"], max_slots=job.get("max_slots", job["threads"]),
        lease_s=job["lease_s"], state_table=define_state_table(sa.MetaData()), on_step=hook,
        pipelined=job.get("pipelined", False), acquire_timeout_s=job.get("acquire_timeout_s", 30.0),
        settle_parallelism=job.get("settle_parallelism", 8),
    )
    signal.signal(signal.SIGTERM, lambda *_: done.set())

    def loop(t: int) -> None:
        n = 0
        limit = job.get("transactions")
        while not done.is_set() and (limit is None or n < limit):
            rid = f"{job['series']}:{job['worker']}:{t}:{n}"
            current.rid = rid  # named in a fault record: the transaction the fault hit
            try:
                with engine.connect() as conn, pool.transaction(conn) as tx:
                    tx.produce(job["topic"], value=rid.encode(), key=f"{job['worker']}:{t}".encode())
                    conn.execute(items.insert().values(id=rid, series=job["series"]))
            except Exception as exc:  # noqa: BLE001 - recorded for the parent
                append_record(results, {"worker": job["worker"], "error": type(exc).__name__, "message": str(exc)[:300],
                                  "id": rid, "t": time.time()})
                time.sleep(0.05)
            else:
                if acks is not None:
                    acks.record(rid)
                append_record(results, {"worker": job["worker"], "ok": rid})
                with lock:
                    started["n"] += 1
            n += 1
            if job.get("pause_s"):
                time.sleep(job["pause_s"])

    threads = [threading.Thread(target=loop, args=(t,), name=f"w{t}") for t in range(job["threads"])]
    for thread in threads:
        thread.start()
    append_record(results, {"worker": job["worker"], "started": os.getpid(), "owner": pool.owner})
    for thread in threads:
        thread.join()
    pool.close()
    append_record(results, {"worker": job["worker"], "closed": True, "metrics": {
        "orphans_settled": pool.metrics().orphans_settled, "leases_lost": pool.metrics().leases_lost}})
    engine.dispose()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
