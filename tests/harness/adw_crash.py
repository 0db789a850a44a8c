"""Crash-test worker for the asyncio dual write: ``_dw_crash.py``'s zygote, with async children.

The jobs are ``_dw_crash.py``'s (same keys, same results file, same exit
codes), so ``test_dual_write_crash.run_series`` drives this zygote
unchanged; only the child differs: it runs :class:`AsyncDualWriter` on an
event loop (``sqlite+aiosqlite://``, ``postgresql+psycopg://`` through
psycopg's async driver), each transaction on an ``AsyncSession`` (odd runs)
or an ``AsyncConnection`` (even runs), and kills itself with SIGKILL at the
job's :class:`Step`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from _dw_crash import Zygote, _append, _kill_self, items_table, session_name  # its directory is on sys.path


def async_url(url: str) -> str:
    """The async driver's URL of a sync URL (psycopg serves both; SQLite through aiosqlite)."""
    return url.replace("sqlite://", "sqlite+aiosqlite://", 1) if url.startswith("sqlite") else url


async def run_async_job(job: dict[str, Any]) -> None:
    """Run one crash job on an event loop in this (forked) process; normally it ends with SIGKILL."""
    from kafka2pc.recipes.dual_write import Step, define_state_table
    from kafka2pc.recipes.dual_write.aio import AsyncDualWriter
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    # On PostgreSQL the sessions carry the run's name, so that the parent can wait for them to end.
    connect_args = {"application_name": session_name(os.getpid())} if job["db_url"].startswith("postgresql") else {}
    engine = create_async_engine(async_url(job["db_url"]), poolclass=sa.pool.NullPool, connect_args=connect_args)
    metadata = sa.MetaData()
    states, items = define_state_table(metadata), items_table(metadata)
    phase: dict[str, Any] = {"name": "recover", "txn": -1, "racing": False}
    point, crash_txn = job.get("point"), job.get("crash_txn", -1)
    rng = random.Random(job.get("seed", 0))

    def hook(step: Step) -> None:
        if phase["name"] == "recover":
            if step.value == job.get("recovery_point"):
                _kill_self()
            return
        if phase["racing"] and step is Step.DB_COMMITTED:
            time.sleep(2.0)  # the killer thread fires during this wait at the latest
            _kill_self()
        if phase["txn"] != crash_txn or step.value != point:
            return
        if step is Step.DB_COMMITTING:
            # "COMMIT sent, reply not received": die 10 us to 30 ms into the COMMIT (log-uniform).
            phase["racing"] = True
            threading.Timer(10 ** rng.uniform(-5.0, -1.5), _kill_self).start()
            return
        _kill_self()

    config = {"bootstrap.servers": job["bootstrap"], "transactional.id": job["tid"]}
    config.update(job.get("producer_config", {}))
    writer = AsyncDualWriter(engine, config, state_table=states, on_step=hook, retain_records=job.get("retain", False),
                             lock_timeout_s=job.get("lock_timeout_s"))
    if job.get("recovery_kill_after_s") is not None:
        threading.Timer(job["recovery_kill_after_s"], _kill_self).start()
    result = await writer.recover(on_heuristic="report")
    settlement = result.settlement
    _append(job["results"], {
        "run": job["run"], "decision": settlement.plan.decision.value if settlement else None,
        "outcome": settlement.outcome.value if settlement else None, "heuristic": result.heuristic,
        "republished": result.republished, "async": True,
    })
    if job.get("recover_only"):
        if job.get("hang_after"):
            _kill_self()
        return
    phase["name"] = "work"
    use_session = job.get("session", job["run"] % 2 == 1)
    for j in range(job.get("transactions", 2)):
        phase["txn"] = j
        async with contextlib.AsyncExitStack() as stack:
            bind: Any = await stack.enter_async_context(AsyncSession(engine) if use_session else engine.connect())
            tx = await stack.enter_async_context(writer.transaction(bind))
            for m in range(job.get("records", 2)):
                rid = f"{job['series']}:{job['run']}-{j}-{m}"
                await bind.execute(items.insert().values(id=rid, series=job["series"]))
                await tx.produce(job["topic"], value=rid.encode(), key=rid.encode())
    if job.get("hang_after"):
        _kill_self()


def zygote() -> None:
    """Read jobs from stdin, fork a child per job, report each child's end on stdout (as ``_dw_crash``)."""
    import confluent_kafka
    import confluent_kafka.admin  # noqa: F401
    import greenlet  # noqa: F401
    import kafka  # noqa: F401
    import kafka2pc.recipes.dual_write.aio
    import psycopg  # noqa: F401
    import sqlalchemy.dialects.postgresql
    import sqlalchemy.dialects.sqlite
    import sqlalchemy.ext.asyncio  # noqa: F401

    import kafka2pc._producer
    import kafka2pc._recovery
    import kafka2pc.aio  # noqa: F401

    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.dup2(2, 1)
            code = 0
            try:
                asyncio.run(run_async_job(job))
            except BaseException as exc:  # noqa: BLE001 - reported through the exit code
                import traceback

                traceback.print_exc()
                sys.stderr.write(f"job {job.get('run')} failed: {exc!r}\n")
                code = 3
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        out.write(json.dumps({"pid": pid, "exit": code}) + "\n")
        out.flush()


class AsyncZygote(Zygote):
    """A :class:`_dw_crash.Zygote` whose children run the asyncio writer."""

    def __init__(self, log_path: Path) -> None:
        import subprocess

        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--zygote"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
        )
        ready = self._read(timeout=60)
        if ready != "ready":
            raise RuntimeError(f"zygote did not start: {ready!r} (see {log_path})")


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    zygote()
