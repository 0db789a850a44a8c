"""WriterPool in one process: leased ids, slots reused, concurrency, exhaustion, races for an expired lease."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa
from harness.dw_crash import check_consistency, items_table
from harness.pool import pool_engine, pool_prefix
from harness.procs import child_env
from kafka2pc.recipes.dual_write import (
    PoolExhaustedError,
    WriterPool,
)

from kafka2pc import ProducerFencedError, TransactionAdmin, UsageError
from kafka2pc.testing import create_topic, wait_for_open_records

WORKER = Path(__file__).with_name("_pool_worker.py")


def _engine(url: str) -> sa.Engine:
    return pool_engine(url, pool_size=12)


def _prefix(name: str) -> str:
    return pool_prefix("pool", name)


def _write(pool: WriterPool, engine: sa.Engine, topic: str, rid: str) -> None:
    items = items_table(sa.MetaData())
    with engine.connect() as conn, pool.transaction(conn) as tx:
        tx.produce(topic, value=rid.encode(), key=rid.encode())
        conn.execute(items.insert().values(id=rid, series=rid.split(":")[0]))


def test_pool_config_errors(pg_url: str, kafka_bootstrap: str) -> None:
    engine = sa.create_engine(pg_url)
    config = {"bootstrap.servers": kafka_bootstrap}
    with pytest.raises(UsageError, match="transactional.id"):
        WriterPool(engine, {**config, "transactional.id": "x"}, prefix="p", size=2, start=False)
    with pytest.raises(UsageError, match="max_slots"):
        WriterPool(engine, config, prefix="p", size=2, max_slots=3, start=False)
    with pytest.raises(UsageError, match="size"):
        WriterPool(engine, config, prefix="p", size=0, start=False)
    with pytest.raises(UsageError, match="lease_s"):
        WriterPool(engine, config, prefix="p", size=2, lease_s=0, start=False)
    engine.dispose()


def test_concurrent_transactions_get_their_own_slots_and_ids_are_reused(db_url: str, kafka_bootstrap: str) -> None:
    engine = _engine(db_url)
    topic = create_topic(kafka_bootstrap, partitions=2)
    prefix = _prefix("conc")
    series = prefix
    pool = WriterPool(engine, {"bootstrap.servers": kafka_bootstrap}, prefix=prefix, size=6, max_slots=3, lease_s=5)
    used: set[str] = set()
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            for n in range(6):
                _write(pool, engine, topic, f"{series}:{t}:{n}")
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    used = set(pool.held_ids)
    assert 1 <= len(used) <= 3
    leases = {lease.transactional_id: lease for lease in pool.leases()}
    assert sorted(leases) == sorted(f"{prefix}-{i}" for i in range(6))
    assert {tid for tid, lease in leases.items() if lease.owner == pool.owner} == used
    assert all(leases[tid].epoch == 1 for tid in used)  # claimed once each, then reused
    metrics = pool.metrics()
    assert metrics.transactions.transactions_committed == 18
    assert metrics.leases_held == len(used)
    pool.close()
    assert all(lease.owner is None for lease in pool.leases())  # released: nothing open under them
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, series)
    assert not problems
    assert rows == records == 18
    engine.dispose()


def test_the_slot_free_the_longest_is_taken_first(pg_url: str, kafka_bootstrap: str) -> None:
    """A slot just given back is taken last: its commit's markers may still be being written.

    A transaction begun on it at once would have its AddPartitionsToTxn refused
    (CONCURRENT_TRANSACTIONS) and wait for librdkafka's retry.  With two slots,
    one thread's transactions therefore alternate between them.
    """
    engine = _engine(pg_url)
    topic = create_topic(kafka_bootstrap)
    prefix = _prefix("lru")
    pool = WriterPool(engine, {"bootstrap.servers": kafka_bootstrap}, prefix=prefix, size=2, max_slots=2, lease_s=5)
    items = items_table(sa.MetaData())
    try:
        # Two transactions at once: the pool makes its two slots.
        with engine.connect() as c1, engine.connect() as c2, pool.transaction(c1) as t1, pool.transaction(c2) as t2:
            for tx, conn, rid in ((t1, c1, f"{prefix}:a"), (t2, c2, f"{prefix}:b")):
                tx.produce(topic, value=rid.encode(), key=rid.encode())
                conn.execute(items.insert().values(id=rid, series=prefix))
        assert len(pool.held_ids) == 2
        used: list[str] = []
        for n in range(6):
            rid = f"{prefix}:{n}"
            with engine.connect() as conn, pool.transaction(conn) as tx:
                tx.produce(topic, value=rid.encode(), key=rid.encode())
                conn.execute(items.insert().values(id=rid, series=prefix))
                used.append(tx.transactional_id)
        assert all(a != b for a, b in zip(used, used[1:])), used
        assert set(used) == set(pool.held_ids)
    finally:
        pool.close()
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, prefix)
    assert not problems and rows == records == 8
    engine.dispose()


def test_pool_exhausted_is_a_typed_error_in_bounded_time(pg_url: str, kafka_bootstrap: str) -> None:
    engine = _engine(pg_url)
    topic = create_topic(kafka_bootstrap)
    prefix = _prefix("full")
    config = {"bootstrap.servers": kafka_bootstrap}
    first = WriterPool(engine, config, prefix=prefix, size=1, lease_s=5)
    second = WriterPool(engine, config, prefix=prefix, size=1, lease_s=5, acquire_timeout_s=1.0)
    try:
        _write(first, engine, topic, f"{prefix}:a")
        began = time.monotonic()
        with pytest.raises(PoolExhaustedError, match="no transactional id free"):
            _write(second, engine, topic, f"{prefix}:b")
        assert time.monotonic() - began < 5
        first.close()  # releases its id: the second instance gets it at once
        _write(second, engine, topic, f"{prefix}:c")
        assert second.held_ids == [f"{prefix}-0"]
    finally:
        first.close()
        second.close()
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, prefix)
    assert not problems and rows == records == 2
    engine.dispose()


def test_the_pool_draws_nothing_from_the_applications_random(
    pg_url: str, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An application that seeds ``random`` to replay its own runs keeps its stream: the pool's shuffles (taking a
    slot, settling orphans) and its scan jitter draw from a generator of the pool's own."""
    callers: list[str] = []
    for name in ("random", "shuffle", "uniform", "choice", "choices", "sample", "randint", "randrange", "getrandbits"):
        def spy(*args: object, _original: object = getattr(random, name), **kwargs: object) -> object:
            callers.append(sys._getframe(1).f_globals.get("__name__", "?"))
            return _original(*args, **kwargs)  # type: ignore[operator]
        monkeypatch.setattr(random, name, spy)
    random.shuffle([1, 2])
    assert callers == [__name__], callers  # the spies see a draw
    engine = _engine(pg_url)
    topic = create_topic(kafka_bootstrap)
    prefix = _prefix("rng")
    config = {"bootstrap.servers": kafka_bootstrap}
    first = WriterPool(engine, config, prefix=prefix, size=2, lease_s=5)
    _write(first, engine, topic, f"{prefix}:a")  # takes a slot
    (orphan,) = first.held_ids
    first.close()
    table = first.lease_table
    with engine.begin() as conn:  # the id's owner died: its lease is expired
        conn.execute(sa.update(table).where(table.c.transactional_id == orphan)
                     .values(owner="dead", expires_at=_utcnow() - timedelta(minutes=1)))
    second = WriterPool(engine, config, prefix=prefix, size=2, lease_s=5, scan_every_s=0.2)
    try:
        deadline = time.monotonic() + 30
        while orphan not in second.held_ids and time.monotonic() < deadline:  # settled by the orphan scan
            time.sleep(0.05)
        assert orphan in second.held_ids, second.leases()
        time.sleep(0.5)  # a few more scans, each with its jitter
        _write(second, engine, topic, f"{prefix}:b")
    finally:
        second.close()
    ours = sorted({c for c in callers if c.startswith(("kafka2pc.recipes", "recipes"))})
    assert not ours, f"drawn from the global random by {ours}"
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, prefix)
    assert not problems and rows == records == 2
    engine.dispose()


def _orphan(engine_url: str, bootstrap: str, topic: str, prefix: str, step: str, tmp_path: Path,
            lease_s: float = 1.5, size: int = 1) -> dict[str, object]:
    """A worker process that leases an id and is SIGKILLed at ``step`` of its 2nd transaction."""
    results = tmp_path / f"{prefix}-{step}.jsonl"
    job = {
        "db_url": engine_url, "bootstrap": bootstrap, "prefix": prefix, "size": size, "threads": 1,
        "lease_s": lease_s, "topic": topic, "series": prefix, "worker": "dead", "results": str(results),
        "kill_at": step, "after": 1, "fault_when_open": step == "produced",
    }
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(job)], timeout=120, capture_output=True, text=True,
                          env=child_env())
    assert proc.returncode == -9, proc.stderr[-3000:]
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    return {"ok": [e["ok"] for e in lines if "ok" in e], "lines": lines}


@pytest.mark.parametrize("step", ["produced", "prepared", "db_committed"])
def test_two_instances_race_for_one_expired_lease(
    db_url: str, kafka_bootstrap: str, tmp_path: Path, step: str
) -> None:
    """Of two instances settling the same orphan at once, exactly one claims and recovers it."""
    engine = _engine(db_url)
    topic = create_topic(kafka_bootstrap)
    prefix = _prefix(f"race-{step}")
    dead = _orphan(db_url, kafka_bootstrap, topic, prefix, step, tmp_path)
    tid = f"{prefix}-0"
    with TransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:
        info = admin.describe_transaction(tid)
        assert info is not None and info.is_open, "the killed instance left its transaction open"
    before = {lease.transactional_id: lease for lease in WriterPool(
        engine, {"bootstrap.servers": kafka_bootstrap}, prefix=prefix, size=1, start=False).leases()}
    time.sleep(max(0.0, (before[tid].expires_at - _utcnow()).total_seconds()) + 0.1)
    config = {"bootstrap.servers": kafka_bootstrap}
    pools = [WriterPool(engine, config, prefix=prefix, size=1, lease_s=5, start=False) for _ in range(2)]
    barrier = threading.Barrier(2)
    found: list[object] = [None, None]

    def settle(i: int) -> None:
        barrier.wait()
        found[i] = pools[i].settle_orphans()

    threads = [threading.Thread(target=settle, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    settled = [r for r in found if r]
    assert len(settled) == 1, found  # exactly one winner; the loser saw the lease taken
    (result,) = settled[0]  # type: ignore[misc]
    decision = result.settlement.plan.decision.value
    assert decision == ("commit" if step == "db_committed" else "abort"), decision
    after = {lease.transactional_id: lease for lease in pools[0].leases()}
    assert after[tid].epoch == before[tid].epoch + 1
    winner = next(p for p in pools if p.held_ids)
    assert after[tid].owner == winner.owner
    with TransactionAdmin(config) as admin:
        info = admin.describe_transaction(tid)
        assert info is not None and not info.is_open
    for p in pools:
        p.close()
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, prefix)
    assert not problems, problems
    assert rows == records == len(dead["ok"]) + (step == "db_committed")  # type: ignore[arg-type]
    engine.dispose()


def _utcnow():  # type: ignore[no-untyped-def]
    return datetime.now(timezone.utc).replace(tzinfo=None)


def test_an_operator_fencing_a_slot_drops_it_and_the_pool_goes_on(pg_url: str, kafka_bootstrap: str) -> None:
    engine = _engine(pg_url)
    topic = create_topic(kafka_bootstrap)
    prefix = _prefix("fenced")
    config = {"bootstrap.servers": kafka_bootstrap}
    pool = WriterPool(engine, config, prefix=prefix, size=2, max_slots=1, lease_s=3)
    try:
        _write(pool, engine, topic, f"{prefix}:0")
        (tid,) = pool.held_ids
        with TransactionAdmin(config) as admin:
            admin.force_terminate_transaction(tid)
        with pytest.raises(ProducerFencedError):
            _write(pool, engine, topic, f"{prefix}:1")
        _write(pool, engine, topic, f"{prefix}:2")  # on another slot (or the same id, recovered)
    finally:
        pool.close()
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, prefix)
    assert not problems and rows == records == 2
    engine.dispose()


@pytest.mark.parametrize("retain", [False, True], ids=["plain", "retain"])
@pytest.mark.parametrize("step", ["kafka_begun", "produced", "prepared", "db_committed"])
def test_an_operator_force_terminating_a_live_transaction(
    pg_url: str, kafka_bootstrap: str, step: str, retain: bool
) -> None:
    """What ``kafka2pc force-terminate`` does to a live writer's transaction (documented in docs/deploying.md).

    Before the first record reached Kafka (``kafka_begun``): the produce is fenced, both sides roll back
    (``ProducerFencedError``).  Once the records were acknowledged (``produced`` + a moment), after the
    prepare, or after the database COMMIT: the prepare only flushes, so nothing notices until the Kafka
    commit; the database commits and Kafka has aborted: a heuristic outcome, raised to the application
    (``HeuristicOutcomeError``); with ``retain_records`` the pool's orphan recovery re-publishes the
    records, so they end up visible exactly once.
    """
    from kafka2pc.recipes.dual_write import Step

    from kafka2pc import HeuristicOutcomeError

    engine = _engine(pg_url)
    metadata = sa.MetaData()
    from kafka2pc.recipes.dual_write import define_outbox_table

    define_outbox_table(metadata).create(engine, checkfirst=True)
    topic = create_topic(kafka_bootstrap)
    prefix = _prefix(f"term-{step}")
    config = {"bootstrap.servers": kafka_bootstrap}
    armed: dict[str, str] = {}
    admin = TransactionAdmin(config)

    def hook(at: Step) -> None:
        if armed and at.value == step:
            tid = armed.pop("tid")
            if step == "produced":  # the record reaches the broker: Ongoing
                wait_for_open_records(kafka_bootstrap, topic)
            admin.force_terminate_transaction(tid)

    pool = WriterPool(engine, config, prefix=prefix, size=2, max_slots=1, lease_s=2, on_step=hook,
                      retain_records=retain)
    try:
        _write(pool, engine, topic, f"{prefix}:0")
        armed["tid"] = pool.held_ids[0]
        committed_in_db = step != "kafka_begun"
        with pytest.raises(HeuristicOutcomeError if committed_in_db else ProducerFencedError):
            _write(pool, engine, topic, f"{prefix}:1")
        assert not armed
        assert pool.metrics().transactions.heuristic_outcomes == (1 if committed_in_db else 0)
        _write(pool, engine, topic, f"{prefix}:2")  # the pool goes on (another id, or the same recovered)
        deadline = time.monotonic() + 20
        while pool.metrics().orphans_settled < 1:  # the fenced id is recovered by the orphan scan
            assert time.monotonic() < deadline, "the terminated id was not recovered"
            time.sleep(0.1)
    finally:
        pool.close()
        admin.close()
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, prefix)
    if committed_in_db and not retain:
        assert problems == [f"committed rows without a record: ['{prefix}:1'] (1)"]
        assert rows == 3 and records == 2
    else:
        assert not problems, problems
        assert rows == records == (3 if committed_in_db else 2)
    engine.dispose()


def test_concurrent_first_starts_start_one_set_of_background_threads(db_url: str, kafka_bootstrap: str) -> None:
    # 32 threads making their first request at once (a Django or gunicorn worker's first burst):
    # one of them records the ids and starts the loops; the others wait for it, then return.
    engine = _engine(db_url)
    prefix = _prefix("start")
    pool = WriterPool(engine, {"bootstrap.servers": kafka_bootstrap}, prefix=prefix, size=4, start=False)
    assert pool.state.value == "new"
    barrier = threading.Barrier(32)
    errors: list[BaseException] = []

    def start() -> None:
        try:
            barrier.wait()
            pool.start()
            assert pool.state.value == "running"  # returns only once the pool is started
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not errors, errors
        names = [t.name for t in threading.enumerate() if t.name.endswith(f"-{prefix}")]
        assert sorted(names) == [f"k2pc-pool-orphans-{prefix}", f"k2pc-pool-renew-{prefix}"], names
        assert len(pool.leases()) == 4
    finally:
        pool.close()
    assert pool.state.value == "closed"
    engine.dispose()
