"""Writers and pools made before a fork, used in two forked children (gunicorn ``--preload``, Celery, uWSGI).

The parent makes the object and runs one transaction with it (an app that warms up at import), then forks
two children (``os.fork`` and ``multiprocessing.get_context("fork")``), which use it at once.  A pool
remakes what cannot cross a fork in each child (producers, background work, leases under an owner id of
the child's own) and completes the children's transactions; a writer, whose transactional id is one
process's, raises :class:`~kafka2pc.ForkedProcessError` at once.  Either way no child waits past its bound
(each has a hard timeout here), and afterwards rows = records, nothing lost, nothing left open, and the
parent's object still works.  Real broker; PostgreSQL and SQLite; sync and asyncio.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from harness.adw_crash import async_url
from harness.dw_crash import check_consistency, items_table
from harness.pool import pool_engine, pool_prefix
from kafka2pc.recipes.dual_write import DualWriter, WriterPool
from kafka2pc.recipes.dual_write.aio import AsyncDualWriter, AsyncWriterPool
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from kafka2pc import ForkedProcessError
from kafka2pc.testing import create_topic

TXNS = 3
"""Transactions per child."""
ACQUIRE_TIMEOUT_S = 15.0
KAFKA_TIMEOUT_S = 10.0
CHILD_BOUND_S = 60.0
"""A child's hard limit: its pool's start, then per transaction ``acquire_timeout_s`` (a lease and its
recovery) and the Kafka calls' ``kafka_timeout_s``, with room for a loaded CI machine."""
AT_ONCE_S = 5.0
"""A writer's child must get its ForkedProcessError within this (it sends nothing first)."""

ITEMS = items_table(sa.MetaData())


def _fork(run: Callable[[], None], how: str) -> Callable[[], int | None]:
    """Start ``run`` in a forked child; return a poll giving its exit code (``None``: still running)."""
    with warnings.catch_warnings():  # Python 3.12+ warns that forking a threaded process may deadlock: the test
        warnings.simplefilter("ignore", DeprecationWarning)
        if how == "os.fork":
            pid = os.fork()
            if pid == 0:  # the child
                code = 1
                try:
                    run()
                    code = 0
                finally:
                    os._exit(code)

            def poll() -> int | None:
                done, status = os.waitpid(pid, os.WNOHANG)
                return None if done == 0 else os.waitstatus_to_exitcode(status)

            poll.pid = pid  # type: ignore[attr-defined]
            return poll
        process = multiprocessing.get_context("fork").Process(target=run, daemon=True)
        process.start()

        def mp_poll() -> int | None:
            return process.exitcode

        mp_poll.pid = process.pid  # type: ignore[attr-defined]
        return mp_poll


def _run_children(child: Callable[[int, Path], None], how: str, out: Path) -> list[dict[str, Any]]:
    """Fork two children running ``child(n, report)``; kill any still running after :data:`CHILD_BOUND_S`."""
    polls = [_fork(lambda n=n: child(n, out / f"child-{n}.json"), how) for n in range(2)]  # type: ignore[misc]
    deadline = time.monotonic() + CHILD_BOUND_S
    codes: list[int | None] = [None, None]
    while time.monotonic() < deadline and None in codes:
        codes = [c if c is not None else poll() for c, poll in zip(codes, polls)]
        time.sleep(0.05)
    for code, poll in zip(codes, polls):
        if code is None:
            os.kill(poll.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    assert None not in codes, f"a child waited past {CHILD_BOUND_S} s: exit codes {codes}"
    paths = [out / f"child-{n}.json" for n in range(2)]
    reports = [json.loads(path.read_text()) if path.exists() else {"outcome": "no report"} for path in paths]
    assert codes == [0, 0], (codes, reports)  # a child that died (a signal, os._exit) wrote no report
    return reports


def _report(path: Path, **fields: Any) -> None:
    path.write_text(json.dumps(fields))


def _sync_write(target: DualWriter | WriterPool, engine: sa.Engine, topic: str, rid: str) -> None:
    with engine.connect() as conn, target.transaction(conn) as tx:
        conn.execute(ITEMS.insert().values(id=rid, series=rid.split(":")[0]))
        tx.produce(topic, key=rid.encode(), value=rid.encode())


async def _async_write(target: AsyncDualWriter | AsyncWriterPool, engine: AsyncEngine, topic: str, rid: str) -> None:
    async with engine.connect() as conn, target.transaction(conn) as tx:
        await conn.execute(ITEMS.insert().values(id=rid, series=rid.split(":")[0]))
        await tx.produce(topic, key=rid.encode(), value=rid.encode())


def _child_outcome(report: Path, work: Callable[[], None]) -> None:
    started = time.monotonic()
    try:
        work()
    except ForkedProcessError as exc:
        _report(report, outcome="forked", pid=exc.pid, elapsed=time.monotonic() - started, message=str(exc))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        _report(report, outcome="error", error="".join(traceback.format_exception(exc)))
    else:
        _report(report, outcome="done", elapsed=time.monotonic() - started)


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
def test_a_pool_made_before_a_fork_serves_each_child(
    db_url: str, kafka_bootstrap: str, how: str, tmp_path: Path
) -> None:
    pool_db = pool_engine(db_url)  # the pool's own engine: remade by the pool itself in each child
    engine = sa.create_engine(db_url, connect_args={"timeout": 30} if "sqlite" in db_url else {})  # the app's
    topic = create_topic(kafka_bootstrap, partitions=2)
    series = pool_prefix("fork", "pool")
    pool = WriterPool(pool_db, {"bootstrap.servers": kafka_bootstrap}, prefix=series, size=6, max_slots=2,
                      lease_s=5, acquire_timeout_s=ACQUIRE_TIMEOUT_S, kafka_timeout_s=KAFKA_TIMEOUT_S)
    _sync_write(pool, engine, topic, f"{series}:parent:0")
    parent_owner = pool.owner

    def child(n: int, report: Path) -> None:
        def work() -> None:
            engine.dispose(close=False)  # the app's step for its own engine (SQLAlchemy's, after fork())
            for i in range(TXNS):
                _sync_write(pool, engine, topic, f"{series}:child{n}:{i}")
            owners.append(pool.owner)
            pool.close(10)

        owners: list[str] = []
        _child_outcome(report, work)
        report.write_text(json.dumps({**json.loads(report.read_text()), "owner": owners[0] if owners else None}))

    reports = _run_children(child, how, tmp_path)
    try:
        assert [r["outcome"] for r in reports] == ["done", "done"], reports
        owners = {r["owner"] for r in reports}
        assert len(owners) == 2 and parent_owner not in owners  # two children never share an owner id
        _sync_write(pool, engine, topic, f"{series}:parent:1")  # the parent's pool is untouched
        assert pool.owner == parent_owner
    finally:
        pool.close()
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, series)
    assert not problems, problems
    assert rows == records == 2 + 2 * TXNS
    engine.dispose()
    pool_db.dispose()


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
def test_a_writer_made_before_a_fork_refuses_each_child_at_once(
    db_url: str, kafka_bootstrap: str, how: str, tmp_path: Path
) -> None:
    engine = pool_engine(db_url)
    topic = create_topic(kafka_bootstrap)
    series = pool_prefix("fork", "writer")
    writer = DualWriter(engine, {"bootstrap.servers": kafka_bootstrap, "transactional.id": series},
                        kafka_timeout_s=KAFKA_TIMEOUT_S)
    _sync_write(writer, engine, topic, f"{series}:parent:0")

    def child(n: int, report: Path) -> None:
        def work() -> None:
            engine.dispose(close=False)  # SQLAlchemy's step for an engine inherited through fork()
            try:
                _sync_write(writer, engine, topic, f"{series}:child{n}:0")
            finally:
                writer.close()  # returns at once: the parent's producer is left alone

        _child_outcome(report, work)

    reports = _run_children(child, how, tmp_path)
    try:
        assert [r["outcome"] for r in reports] == ["forked", "forked"], reports
        assert all(r["pid"] == os.getpid() and r["elapsed"] < AT_ONCE_S for r in reports), reports
        assert "post_worker_init" in reports[0]["message"]
        _sync_write(writer, engine, topic, f"{series}:parent:1")
    finally:
        writer.close()
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, series)
    assert not problems, problems
    assert rows == records == 2
    engine.dispose()


@pytest.mark.parametrize(("kind", "how"), [("pool", "os.fork"), ("pool", "multiprocessing"),
                                           ("writer", "os.fork"), ("writer", "multiprocessing")])
def test_the_asyncio_twins_made_before_a_fork(
    db_url: str, kafka_bootstrap: str, kind: str, how: str, tmp_path: Path
) -> None:
    pool_engine(db_url).dispose()  # the tables
    engine = create_async_engine(async_url(db_url), connect_args={"timeout": 30} if "sqlite" in db_url else {})
    topic = create_topic(kafka_bootstrap, partitions=2)
    series = pool_prefix("fork", f"a{kind}")
    config = {"bootstrap.servers": kafka_bootstrap}
    target: AsyncDualWriter | AsyncWriterPool
    if kind == "pool":
        target = AsyncWriterPool(engine, config, prefix=series, size=6, max_slots=2, lease_s=5,
                                 acquire_timeout_s=ACQUIRE_TIMEOUT_S, kafka_timeout_s=KAFKA_TIMEOUT_S)
    else:
        target = AsyncDualWriter(engine, {**config, "transactional.id": series}, kafka_timeout_s=KAFKA_TIMEOUT_S)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(_async_write(target, engine, topic, f"{series}:parent:0"))

    def child(n: int, report: Path) -> None:
        async def work() -> None:
            engine.sync_engine.dispose(close=False)  # SQLAlchemy's step after fork() (the pool does it too)
            try:
                for i in range(TXNS):
                    await _async_write(target, engine, topic, f"{series}:child{n}:{i}")
            finally:
                await target.close(10)

        _child_outcome(report, lambda: asyncio.run(work()))

    try:
        reports = _run_children(child, how, tmp_path)
        if kind == "pool":
            assert [r["outcome"] for r in reports] == ["done", "done"], reports
        else:
            assert [r["outcome"] for r in reports] == ["forked", "forked"], reports
            assert all(r["elapsed"] < AT_ONCE_S for r in reports), reports
        loop.run_until_complete(_async_write(target, engine, topic, f"{series}:parent:1"))
    finally:
        loop.run_until_complete(target.close())
        loop.run_until_complete(engine.dispose())
        loop.close()
    sync_engine = sa.create_engine(db_url)
    rows, records, problems = check_consistency(sync_engine, kafka_bootstrap, topic, series)
    assert not problems, problems
    assert rows == records == 2 + (2 * TXNS if kind == "pool" else 0)
    sync_engine.dispose()
