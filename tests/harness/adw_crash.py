"""Crash-test worker for the asyncio dual write: ``harness/dw_crash.py``'s zygote, with async children.

The jobs are ``harness/dw_crash.py``'s (same keys, same results file, same exit
codes), so ``harness.crash_matrix.run_series`` drives this zygote
unchanged; only the child differs: it runs :class:`AsyncDualWriter` on an
event loop (``sqlite+aiosqlite://``, ``postgresql+psycopg://`` through
psycopg's async driver), each transaction on an ``AsyncSession`` (odd runs)
or an ``AsyncConnection`` (even runs), and kills itself with SIGKILL at the
job's :class:`Step`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from typing import Any

import sqlalchemy as sa

from harness.dw_crash import (
    Zygote,
    ack_log,
    acknowledge,
    append_record,
    items_table,
    kill_self,
    serve,
    session_name,
    step_hook,
)


def async_url(url: str) -> str:
    """The async driver's URL of a sync URL (psycopg serves both; SQLite through aiosqlite)."""
    return url.replace("sqlite://", "sqlite+aiosqlite://", 1) if url.startswith("sqlite") else url


async def run_async_job(job: dict[str, Any]) -> None:
    """Run one crash job on an event loop in this (forked) process; normally it ends with SIGKILL."""
    from kafka2pc.recipes.dual_write import define_state_table
    from kafka2pc.recipes.dual_write.aio import AsyncDualWriter
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    # On PostgreSQL the sessions carry the run's name, so that the parent can wait for them to end.
    connect_args = {"application_name": session_name(os.getpid())} if job["db_url"].startswith("postgresql") else {}
    engine = create_async_engine(async_url(job["db_url"]), poolclass=sa.pool.NullPool, connect_args=connect_args)
    metadata = sa.MetaData()
    states, items = define_state_table(metadata), items_table(metadata)
    phase: dict[str, Any] = {"name": "recover", "txn": -1, "racing": False}
    hook = step_hook(job, phase)

    config = {"bootstrap.servers": job["bootstrap"], "transactional.id": job["tid"]}
    config.update(job.get("producer_config", {}))
    writer = AsyncDualWriter(engine, config, state_table=states, on_step=hook, retain_records=job.get("retain", False),
                             lock_timeout_s=job.get("lock_timeout_s"))
    if job.get("recovery_kill_after_s") is not None:
        threading.Timer(job["recovery_kill_after_s"], kill_self).start()
    result = await writer.recover(on_heuristic="report")
    settlement = result.settlement
    append_record(job["results"], {
        "run": job["run"], "decision": settlement.plan.decision.value if settlement else None,
        "outcome": settlement.outcome.value if settlement else None, "heuristic": result.heuristic,
        "republished": result.republished, "async": True,
    })
    if job.get("recover_only"):
        if job.get("hang_after"):
            kill_self()
        return
    phase["name"] = "work"
    use_session = job.get("session", job["run"] % 2 == 1)
    acks = ack_log(job)
    for j in range(job.get("transactions", 2)):
        phase["txn"] = j
        rids = [f"{job['series']}:{job['run']}-{j}-{m}" for m in range(job.get("records", 2))]
        async with contextlib.AsyncExitStack() as stack:
            bind: Any = await stack.enter_async_context(AsyncSession(engine) if use_session else engine.connect())
            tx = await stack.enter_async_context(writer.transaction(bind))
            for rid in rids:
                await bind.execute(items.insert().values(id=rid, series=job["series"]))
                await tx.produce(job["topic"], value=rid.encode(), key=rid.encode())
        acknowledge(acks, rids)  # the block returned: acknowledged (a blocking fsync, as the sync child's)
    if job.get("hang_after"):
        kill_self()


def zygote() -> None:
    """Import the asyncio writer's dependencies, then serve jobs (:func:`harness.dw_crash.serve`) on an event loop each."""
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

    serve(lambda job: asyncio.run(run_async_job(job)))


class AsyncZygote(Zygote):
    """A :class:`harness.dw_crash.Zygote` whose children run the asyncio writer."""

    module = "harness.adw_crash"


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    zygote()
