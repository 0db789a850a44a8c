"""AsyncWriterPool: many tasks on one pool, slots reused, an instance killed with kill -9 holding leases, a race.

Real broker, PostgreSQL (psycopg async) and SQLite (aiosqlite).  The killed
instance is this file run as a script (``main``): an ``AsyncWriterPool`` and
tasks writing through it until a step hook SIGKILLs the process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest  # noqa: E402
import sqlalchemy as sa  # noqa: E402
from harness.acks import AckLog
from harness.adw_crash import async_url
from harness.dw_crash import append_record, check_consistency, items_table  # noqa: E402
from harness.loop import MeasuredLoop, assert_loop_not_blocked
from harness.pool import pool_engine, pool_prefix  # noqa: E402
from harness.procs import CpuWaitLog, child_env
from kafka2pc.recipes.dual_write import PoolExhaustedError, Step, define_lease_table  # noqa: E402
from kafka2pc.recipes.dual_write.aio import AsyncWriterPool  # noqa: E402
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine  # noqa: E402

from kafka2pc import UsageError  # noqa: E402
from kafka2pc.testing import create_topic  # noqa: E402


def _async_engine(url: str) -> AsyncEngine:
    connect_args = {"timeout": 30} if url.startswith("sqlite") else {}
    # Each task holds its connection while it waits for a slot: room for them all, plus the pool's own.
    return create_async_engine(async_url(url), connect_args=connect_args, pool_size=40)


def _setup(url: str) -> sa.Engine:
    return pool_engine(url)


def _prefix(name: str) -> str:
    return pool_prefix("apool", name)


async def _write(pool: AsyncWriterPool, engine: AsyncEngine, topic: str, rid: str, *, fail: bool = False) -> None:
    items = items_table(sa.MetaData())
    async with engine.connect() as conn, pool.transaction(conn) as tx:
        await conn.execute(items.insert().values(id=rid, series=rid.split(":")[0]))
        await tx.produce(topic, value=rid.encode(), key=rid.encode())
        if fail:
            raise LookupError("the application failed: both sides roll back")


def test_async_pool_config_errors(pg_url: str, kafka_bootstrap: str) -> None:
    config = {"bootstrap.servers": kafka_bootstrap}

    async def scenario() -> None:
        engine = _async_engine(pg_url)
        with pytest.raises(UsageError, match="max_in_flight"):
            AsyncWriterPool(engine, config, prefix="p", size=2, pipelined=True, max_in_flight=0)
        with pytest.raises(UsageError, match="max_slots"):
            AsyncWriterPool(engine, config, prefix="p", size=2, max_slots=3)
        with pytest.raises(UsageError, match="transactional.id"):
            AsyncWriterPool(engine, {**config, "transactional.id": "x"}, prefix="p", size=2)
        await engine.dispose()

    with pytest.raises(UsageError, match="AsyncEngine"):
        AsyncWriterPool(sa.create_engine(pg_url), config, prefix="p", size=2)  # type: ignore[arg-type]
    asyncio.run(scenario())


@pytest.mark.quiet  # measures the loop's lateness
def test_many_tasks_share_bounded_reused_slots(db_url: str, kafka_bootstrap: str) -> None:
    """32 tasks x 3 transactions (every 7th fails) on 3 slots: I1-I5, ids reused, exhaustion typed, loop free."""
    sync_engine = _setup(db_url)
    topic = create_topic(kafka_bootstrap, partitions=2)
    prefix = _prefix("conc")

    async def scenario() -> dict[str, Any]:
        engine = _async_engine(db_url)
        monitor = MeasuredLoop()
        pool = AsyncWriterPool(engine, {"bootstrap.servers": kafka_bootstrap}, prefix=prefix, size=4, max_slots=3,
                               lease_s=5)
        ok: list[str] = []
        peak = 0

        async def run(t: int) -> None:
            nonlocal peak
            for n in range(3):
                rid = f"{prefix}:{t}:{n}"
                fail = (t * 3 + n) % 7 == 0
                try:
                    await _write(pool, engine, topic, rid, fail=fail)
                except LookupError:
                    assert fail
                    continue
                ok.append(rid)
                peak = max(peak, pool.metrics().leases_held)

        async with pool:
            async with monitor:
                await asyncio.gather(*(run(t) for t in range(32)))
            held = pool.held_ids
            leases = {lease.transactional_id: lease for lease in await pool.leases()}
            metrics = pool.metrics()
            # The 4th id is free: another instance gets it, then nothing is left for a third.
            other = AsyncWriterPool(engine, {"bootstrap.servers": kafka_bootstrap}, prefix=prefix, size=4,
                                    max_slots=2, acquire_timeout_s=1.0, lease_s=5)
            async with other:
                async with engine.connect() as conn, other.transaction(conn) as tx:
                    began = time.monotonic()
                    async with MeasuredLoop() as waiting:  # waiting for a slot leaves the loop free
                        with pytest.raises(PoolExhaustedError, match="no transactional id free"):
                            await _write(other, engine, topic, f"{prefix}:x:0")
                    exhausted_after = time.monotonic() - began
                    await conn.execute(items_table(sa.MetaData()).insert().values(id=f"{prefix}:o:0", series=prefix))
                    await tx.produce(topic, value=f"{prefix}:o:0".encode())
                ok.append(f"{prefix}:o:0")
        after_close = await pool.leases()
        await engine.dispose()
        return {"ok": ok, "held": held, "leases": leases, "metrics": metrics, "peak": peak,
                "stall": monitor, "waiting": waiting, "exhausted_after": exhausted_after, "after_close": after_close,
                "owner": pool.owner}

    out = asyncio.run(scenario())
    held, leases, metrics = out["held"], out["leases"], out["metrics"]
    assert len(held) == 3 and out["peak"] <= 3  # bounded by max_slots (32 tasks: all 3 used)
    assert {tid for tid, lease in leases.items() if lease.owner == out["owner"]} == set(held)
    assert all(leases[tid].epoch == 1 for tid in held)  # claimed once each, then reused for 96 transactions
    failed = sum((t * 3 + n) % 7 == 0 for t in range(32) for n in range(3))
    assert metrics.transactions.transactions_committed == 96 - failed
    assert metrics.transactions.transactions_rolled_back == failed
    assert metrics.slots_busy == 0
    assert out["exhausted_after"] < 3
    assert all(lease.owner is None for lease in out["after_close"])  # released at close: nothing open
    rows, records, problems = check_consistency(sync_engine, kafka_bootstrap, topic, prefix)
    assert not problems, problems
    assert rows == records == len(out["ok"]) == 96 - failed + 1
    # Busy by design: bound the p99.  Waiting for a slot leaves the loop free (a blocking wait would hold it 1 s):
    # no tick over the bound but those the loop thread's wait for a CPU explains, stalled under a quarter of it.
    assert_loop_not_blocked(out["stall"], f"async pool, 32 tasks on {len(held)} slots", busy=True)
    assert_loop_not_blocked(out["waiting"], f"waiting {out['exhausted_after']:.2f} s for a slot",
                            stalled_fraction=0.25, late_ticks=0)
    sync_engine.dispose()


def test_a_task_cancelled_while_waiting_for_a_slot_leaves_nothing_held(
    pg_url: str, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One slot: a second task waits for it and is cancelled; once the first ends the slot is free again."""
    from kafka2pc.recipes.dual_write.aio import _runtime as aio_runtime

    sync_engine = _setup(pg_url)
    topic = create_topic(kafka_bootstrap)
    prefix = _prefix("cancel")
    waits_entered = asyncio.Event()
    wait = aio_runtime._LoopCondition.wait  # noqa: SLF001 - observed, not changed: when a task starts waiting

    def observed_wait(self: Any, timeout: float | None = None) -> bool:
        waits_entered.set()
        return wait(self, timeout)

    monkeypatch.setattr(aio_runtime._LoopCondition, "wait", observed_wait)  # noqa: SLF001

    async def scenario() -> Any:
        engine = _async_engine(pg_url)
        async with AsyncWriterPool(engine, {"bootstrap.servers": kafka_bootstrap}, prefix=prefix, size=1,
                                   lease_s=5) as pool:
            release = asyncio.Event()

            async def holder() -> None:
                items = items_table(sa.MetaData())
                async with engine.connect() as conn, pool.transaction(conn) as tx:
                    await conn.execute(items.insert().values(id=f"{prefix}:held", series=prefix))
                    await tx.produce(topic, value=f"{prefix}:held".encode())
                    await release.wait()

            first = asyncio.ensure_future(holder())
            while pool.metrics().slots_busy == 0:
                await asyncio.sleep(0.01)
            waiting = asyncio.ensure_future(_write(pool, engine, topic, f"{prefix}:cancelled"))
            # Cancelled once it waits for the only slot (the pool's condition, answered by the loop).
            entered = asyncio.ensure_future(waits_entered.wait())
            await asyncio.wait({entered, waiting}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            if waiting.done():
                entered.cancel()
                raise AssertionError(f"the task did not wait for the busy slot: {waiting.exception()!r}")
            assert entered.done(), "the task did not start waiting for the slot within 10 s"
            assert pool.metrics().slots_busy == 1
            waiting.cancel()
            release.set()
            await first
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert pool.metrics().slots_busy == 0
            await asyncio.wait_for(_write(pool, engine, topic, f"{prefix}:next"), 10)  # the slot was given back
            metrics = pool.metrics()
        await engine.dispose()
        return metrics

    metrics = asyncio.run(scenario())
    assert metrics.transactions.transactions_committed == 2
    assert metrics.transactions.transactions_rolled_back == 1  # the cancelled task's, entered after it was cancelled
    assert sorted(_rows(sync_engine, prefix)) == [f"{prefix}:held", f"{prefix}:next"]
    rows, records, problems = check_consistency(sync_engine, kafka_bootstrap, topic, prefix)
    assert not problems, problems
    assert rows == records == 2
    sync_engine.dispose()


def test_sync_and_async_instances_share_one_prefix(pg_url: str, kafka_bootstrap: str) -> None:
    """A WriterPool (threads) and an AsyncWriterPool lease distinct ids of one set at once; I1-I5 hold."""
    import threading

    from kafka2pc.recipes.dual_write import WriterPool

    sync_engine = _setup(pg_url)
    topic = create_topic(kafka_bootstrap)
    prefix = _prefix("mixed")
    config = {"bootstrap.servers": kafka_bootstrap}
    sync_pool = WriterPool(sync_engine, config, prefix=prefix, size=4, max_slots=2, lease_s=5)
    items = items_table(sa.MetaData())
    errors: list[BaseException] = []

    def sync_writes(t: int) -> None:
        try:
            for n in range(5):
                rid = f"{prefix}:s{t}:{n}"
                with sync_engine.connect() as conn, sync_pool.transaction(conn) as tx:
                    conn.execute(items.insert().values(id=rid, series=prefix))
                    tx.produce(topic, value=rid.encode())
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    async def scenario() -> tuple[list[str], list[str]]:
        engine = _async_engine(pg_url)
        async with AsyncWriterPool(engine, config, prefix=prefix, size=4, max_slots=2, lease_s=5) as pool:
            threads = [threading.Thread(target=sync_writes, args=(t,)) for t in range(2)]
            for thread in threads:
                thread.start()
            await asyncio.gather(*(_write(pool, engine, topic, f"{prefix}:a{t}:{n}")
                                   for t in range(2) for n in range(5)))
            await asyncio.to_thread(lambda: [thread.join() for thread in threads])
            held = (pool.held_ids, sync_pool.held_ids)
        await engine.dispose()
        return held

    async_held, sync_held = asyncio.run(scenario())
    sync_pool.close()
    assert not errors, errors
    assert async_held and sync_held and not set(async_held) & set(sync_held)  # one id, one owner
    rows, records, problems = check_consistency(sync_engine, kafka_bootstrap, topic, prefix)
    assert not problems, problems
    assert rows == records == 20
    sync_engine.dispose()


# -- a killed instance -------------------------------------------------------------------------------
def _run_child(tmp_path: Path, job: dict[str, Any]) -> list[dict[str, Any]]:
    results = tmp_path / f"{job['prefix']}.jsonl"
    job = {**job, "results": str(results)}
    proc = subprocess.run([sys.executable, __file__, json.dumps(job)], timeout=120, capture_output=True, text=True,
                          env=child_env())
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    return [json.loads(line) for line in results.read_text().splitlines()]


def _lease_rows(engine: sa.Engine, prefix: str) -> list[sa.Row[Any]]:
    t = define_lease_table(sa.MetaData())
    with engine.connect() as conn:
        return list(conn.execute(sa.select(t.c.transactional_id, t.c.owner, t.c.expires_at, t.c.epoch)
                                 .where(t.c.pool == prefix)).all())


KILL_STEPS = ["db_committed", "prepared", "state_stored", "produced", "kafka_committed"]
KILLS = int(os.environ.get("KAFKA2PC_ASYNC_POOL_KILLS", "1"))
SETTLE_S = 2.0
"""The recovery's part of the settlement bound: claims, new producers, EndTxns of the dead instance's ids
(settled in parallel), net of this process's waits for a CPU."""
"""Instances killed by the kill -9 test, each at the next of ``KILL_STEPS`` (CI: 1, at ``db_committed``)."""


def test_orphans_of_an_instance_killed_with_kill_9_are_settled_by_another_async_pool(
    pg_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """4 tasks hold 4 leases; kill -9 when one is at a step (first: past its database COMMIT); another pool
    settles them all within about lease_s + scan_every_s, committing exactly what the database committed."""
    sync_engine = _setup(pg_url)
    lease_s, scan_s = 2.0, 0.5
    timings = []
    for kill in range(KILLS):
        step = KILL_STEPS[kill % len(KILL_STEPS)]
        timings.append(_kill_and_settle(sync_engine, pg_url, kafka_bootstrap, tmp_path, step, lease_s, scan_s))
    print(f"\n{KILLS} kill -9 runs (lease_s={lease_s}, scan_every_s={scan_s}): orphans settled "
          + ", ".join(f"{n} at {step} in {t:.2f} s" for step, n, t in timings) + " after the kill")
    sync_engine.dispose()


def _kill_and_settle(sync_engine: sa.Engine, pg_url: str, kafka_bootstrap: str, tmp_path: Path, step: str,
                     lease_s: float, scan_s: float) -> tuple[str, int, float]:
    topic = create_topic(kafka_bootstrap)
    prefix = _prefix("kill")
    acks = AckLog(tmp_path / f"{prefix}.acks")
    lines = _run_child(tmp_path, {"db_url": pg_url, "bootstrap": kafka_bootstrap, "topic": topic, "prefix": prefix,
                                  "size": 6, "tasks": 4, "lease_s": lease_s, "kill_at": step, "after": 8,
                                  "ack_log": str(acks.path)})
    killed_at = time.monotonic()
    cpu_waits = CpuWaitLog()  # this process runs the settling pool: its waits for a CPU are not the pool's
    cpu_waits.sample([os.getpid()], killed_at)
    bound_s = lease_s + 1.2 * scan_s + SETTLE_S  # the contract (docs/deploying.md): lease + one scan + the recovery
    owner = next(e["owner"] for e in lines if "owner" in e)
    ok = [e["ok"] for e in lines if "ok" in e]
    dead = {r[0] for r in _lease_rows(sync_engine, prefix) if r[1] == owner}
    assert len(dead) >= 3, "the killed instance held several leases"

    async def scenario() -> tuple[float, Any]:
        engine = _async_engine(pg_url)
        # 2 slots: 2 orphans become slots (the writer's recovery), the others are settled through an
        # AsyncTransactionAdmin per settling task and released.
        pool = AsyncWriterPool(engine, {"bootstrap.servers": kafka_bootstrap}, prefix=prefix, size=6,
                               max_slots=2, lease_s=lease_s, scan_every_s=scan_s)
        async with pool:
            while pool.metrics().orphans_settled + pool.metrics().orphan_recovery_errors < len(dead):
                now = time.monotonic()
                cpu_waits.sample([os.getpid()], now)
                net = now - killed_at - cpu_waits.waited_s(killed_at, now)
                assert net < bound_s, f"orphans not settled {net:.2f} s after the kill (less CPU waits)"
                await asyncio.sleep(0.05)
            now = time.monotonic()
            cpu_waits.sample([os.getpid()], now)
            settled_after = now - killed_at - cpu_waits.waited_s(killed_at, now)
            metrics = pool.metrics()
            assert len(pool.held_ids) == 2 and set(pool.held_ids) <= dead
            await _write(pool, engine, topic, f"{prefix}:after:0")  # and the pool goes on
        await engine.dispose()
        return settled_after, metrics

    settled_after, metrics = asyncio.run(scenario())
    assert metrics.orphans_settled == len(dead)
    assert not any(r[1] == owner for r in _lease_rows(sync_engine, prefix))
    assert metrics.orphan_recovery_errors == 0
    assert settled_after < bound_s, settled_after
    # Every acknowledged transaction is there, once on each side (and the one killed past its database
    # COMMIT: recovery committed it).
    rows, records, problems = check_consistency(sync_engine, kafka_bootstrap, topic, prefix, acks)
    assert not problems, (step, problems)
    assert sorted(acks.ids()) == sorted(ok)
    assert rows == records >= len(ok) + 1 + (step in ("db_committed", "kafka_committed"))
    return step, len(dead), settled_after


def _rows(engine: sa.Engine, series: str) -> list[str]:
    items = items_table(sa.MetaData())
    with engine.connect() as conn:
        return list(conn.execute(sa.select(items.c.id).where(items.c.series == series)).scalars())


@pytest.mark.parametrize("step", ["prepared", "db_committed"])
def test_two_async_pools_race_for_one_expired_lease(
    db_url: str, kafka_bootstrap: str, tmp_path: Path, step: str
) -> None:
    """Of two async pools settling one orphan at once, exactly one claims and recovers it, as the database says."""
    sync_engine = _setup(db_url)
    topic = create_topic(kafka_bootstrap)
    prefix = _prefix(f"race-{step}")
    acks = AckLog(tmp_path / f"{prefix}.acks")
    lines = _run_child(tmp_path, {"db_url": db_url, "bootstrap": kafka_bootstrap, "topic": topic, "prefix": prefix,
                                  "size": 1, "tasks": 1, "lease_s": 1.0, "kill_at": step, "after": 1,
                                  "ack_log": str(acks.path)})
    ok = [e["ok"] for e in lines if "ok" in e]
    ((tid, _, expires_at, epoch),) = _lease_rows(sync_engine, prefix)
    time.sleep(max(0.0, (expires_at - _utcnow()).total_seconds()) + 0.1)

    async def scenario() -> tuple[list[Any], list[list[str]]]:
        engines = [_async_engine(db_url) for _ in range(2)]
        config = {"bootstrap.servers": kafka_bootstrap}
        pools = [AsyncWriterPool(e, config, prefix=prefix, size=1, lease_s=5) for e in engines]
        found = await asyncio.gather(*(p.settle_orphans() for p in pools))
        held = [p.held_ids for p in pools]
        for p in pools:
            await p.close()
        for e in engines:
            await e.dispose()
        return list(found), held

    found, held = asyncio.run(scenario())
    settled = [r for r in found if r]
    assert len(settled) == 1, found  # exactly one winner; the other saw the lease taken
    (result,) = settled[0]
    assert result.settlement.plan.decision.value == ("commit" if step == "db_committed" else "abort")
    assert sorted(len(h) for h in held) == [0, 1]  # the winner kept the id as a slot
    ((_, _, _, epoch_after),) = _lease_rows(sync_engine, prefix)
    assert epoch_after == epoch + 1
    rows, records, problems = check_consistency(sync_engine, kafka_bootstrap, topic, prefix, acks)
    assert not problems, problems
    assert sorted(acks.ids()) == sorted(ok) and ok
    assert rows == records == len(ok) + (step == "db_committed")
    sync_engine.dispose()


def _utcnow():  # type: ignore[no-untyped-def]
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).replace(tzinfo=None)


# -- the child instance ------------------------------------------------------------------------------
async def _child(job: dict[str, Any]) -> None:
    engine = _async_engine(job["db_url"])
    acks = AckLog(job["ack_log"]) if job.get("ack_log") else None
    committed = {"n": 0}

    def hook(step: Step) -> None:
        if step.value == job["kill_at"] and committed["n"] >= job["after"]:
            os.kill(os.getpid(), signal.SIGKILL)

    pool = AsyncWriterPool(engine, {"bootstrap.servers": job["bootstrap"]}, prefix=job["prefix"], size=job["size"],
                           max_slots=job["tasks"], lease_s=job["lease_s"], on_step=hook)
    await pool.start()
    append_record(job["results"], {"owner": pool.owner})

    async def run(t: int) -> None:
        for n in range(1000):
            rid = f"{job['prefix']}:{t}:{n}"
            await _write(pool, engine, job["topic"], rid)
            committed["n"] += 1
            if acks is not None:
                acks.record(rid)  # acknowledged: fsynced before anything else
            append_record(job["results"], {"ok": rid})

    await asyncio.gather(*(run(t) for t in range(job["tasks"])))


if __name__ == "__main__":
    asyncio.run(_child(json.loads(sys.argv[1])))
