"""WriterPool under process faults, on PostgreSQL and a real broker: kill -9, scale-down/up, SIGSTOP zombies.

Each instance is a real process (``_pool_worker.py``) with a pool and writer
threads.  Checked at the end, with a ``read_committed`` consumer and the
database (I1-I5): every committed row has exactly one visible record and
vice versa (no duplicate, nothing lost, no record of a rolled-back
transaction), every transaction acknowledged to a worker's thread is in the
database and exactly once among the ``read_committed`` records (the workers'
fsynced acknowledged-write log, ``harness.acks``), and the ``read_committed``
end offset equals the ``read_uncommitted`` one.  A watcher samples the coordinator while the
instances run: no transaction of the pool stays open longer than one lease
plus one orphan scan plus the recovery, less the time the instances waited
for a CPU meanwhile (the machine is shared).

``KAFKA2PC_POOL_CHAOS_S`` sizes the kill -9 run (default 15 s in CI); its schedule of kills is drawn
from the test's seed (``$KAFKA2PC_SEED``, printed). The watcher's thread fails the test if it fails.
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import sqlalchemy as sa
from harness.acks import AckLog
from harness.dw_crash import check_consistency, items_table
from harness.kafka_judge import assert_nothing_open
from harness.pool import pool_engine
from harness.procs import CpuWaitLog, child_env
from kafka2pc.recipes.dual_write import WriterPool, define_lease_table

from kafka2pc import TransactionAdmin
from kafka2pc.testing import create_topic

WORKER = Path(__file__).with_name("_pool_worker.py")
CHAOS_S = float(os.environ.get("KAFKA2PC_POOL_CHAOS_S", "15"))
LEASE_S = 2.0
SCAN_S = LEASE_S / 3
#: A transaction left by a killed instance is settled within lease + scan + recovery; the recovery
#: (a claim, a new producer, EndTxn) takes well under a second alone.  Checked against the time the
#: transaction stayed open less the time the instances waited for a CPU meanwhile (harness.procs.CpuWaitLog).
OPEN_BOUND_S = LEASE_S + SCAN_S * 1.2 + 6.0


def _engine(url: str) -> sa.Engine:
    return pool_engine(url, pool_size=8)


@pytest.fixture(autouse=True)
def kill_leftover_instances() -> Iterator[None]:
    """No worker process outlives its test, even a failed one (it would go on writing and load the machine)."""
    yield
    while Cluster.live:
        for proc in Cluster.live.pop().procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@dataclass
class Cluster:
    """The instances of one test: worker processes sharing a pool prefix, and what they reported."""

    url: str
    bootstrap: str
    topic: str
    prefix: str
    size: int
    workdir: Path
    threads: int = 2
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    count: int = 0
    live: ClassVar[list[Cluster]] = []  # killed after each test (see kill_leftover_instances)

    def __post_init__(self) -> None:
        Cluster.live.append(self)

    @property
    def results(self) -> Path:
        return self.workdir / f"{self.prefix}.jsonl"

    @property
    def acks(self) -> AckLog:
        """The acknowledged-write log every instance appends to (fsynced: it survives their kill -9)."""
        return AckLog(self.workdir / f"{self.prefix}.acks")

    def start(self, **extra: Any) -> str:
        name = f"w{self.count}"
        self.count += 1
        job = {
            "db_url": self.url, "bootstrap": self.bootstrap, "prefix": self.prefix, "size": self.size,
            "threads": self.threads, "lease_s": LEASE_S, "topic": self.topic, "series": self.prefix,
            "worker": name, "results": str(self.results), "ack_log": str(self.acks.path), "pause_s": 0.02, **extra,
        }
        log = open(self.workdir / f"{self.prefix}-{name}.log", "ab")  # noqa: SIM115 - the child owns it
        self.procs[name] = subprocess.Popen([sys.executable, str(WORKER), json.dumps(job)], stderr=log, stdout=log,
                                               env=child_env())
        log.close()
        return name

    def lines(self) -> list[dict[str, Any]]:
        if not self.results.exists():
            return []
        return [json.loads(line) for line in self.results.read_text().splitlines() if line.strip()]

    def owner(self, name: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for entry in self.lines():
                if entry.get("worker") == name and "owner" in entry:
                    return str(entry["owner"])
            time.sleep(0.1)
        raise AssertionError(f"{name} did not start")

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs.values() if proc.poll() is None]

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise AssertionError(f"{name} did not stop on SIGTERM") from None


class OpenWatcher:
    """Samples the coordinator's view of every id of the pool: the longest time any transaction stayed open.

    ``longest_s`` is wall-clock; ``longest_net_s`` (what the bound is checked on) takes away, for each
    transaction, the most any live instance waited for a CPU while it was open.
    """

    def __init__(self, bootstrap: str, ids: list[str], cluster: Cluster) -> None:
        self._ids = ids
        self._cluster = cluster
        self._admin = TransactionAdmin({"bootstrap.servers": bootstrap})
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.samples = 0
        self.cpu_waits = CpuWaitLog()
        self.longest_s = 0.0
        self.longest_net_s = 0.0
        self.longest: tuple[str, str] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._sample_until_stopped()
        except BaseException as exc:  # noqa: BLE001 - re-raised by stop(): a dead watcher makes the bound vacuous
            self.error = exc

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(0.25):
            self.cpu_waits.sample(self._cluster.pids(), time.monotonic())
            for tid in self._ids:
                info = self._admin.describe_transaction(tid)
                if info is None or not info.is_open:
                    continue
                now, open_s = time.monotonic(), info.open_for_s or 0.0
                self.longest_s = max(self.longest_s, open_s)
                net = open_s - self.cpu_waits.waited_s(now - open_s, now)
                if net > self.longest_net_s:
                    self.longest_net_s = net
                    self.longest = (tid, info.state)
            self.samples += 1

    def stop(self) -> float:
        """Stop sampling; the longest time a transaction stayed open (net of CPU waits). Raises what the
        sampling thread raised, and fails when it took no sample (the bound would have checked nothing)."""
        self._stop.set()
        self._thread.join(30)
        self._admin.close()
        assert not self._thread.is_alive(), "the watcher did not stop in 30 s"
        if self.error is not None:
            raise AssertionError(f"the watcher failed after {self.samples} samples: {self.error!r}") from self.error
        assert self.samples > 0, "the watcher took no sample"
        return self.longest_net_s


def _finish(cluster: Cluster, engine: sa.Engine) -> dict[str, Any]:
    """Stop every instance, let one last instance settle what is left, check I1-I5; a summary."""
    cluster.stop_all()
    time.sleep(LEASE_S + 0.2)  # leases of killed instances expire
    last = WriterPool(engine, {"bootstrap.servers": cluster.bootstrap}, prefix=cluster.prefix, size=cluster.size,
                      lease_s=LEASE_S, start=False)
    try:
        settled = last.settle_orphans()
        assert all(r.error is None for r in settled), [r.error for r in settled]
    finally:
        last.close()
    # Acknowledged (fsynced by the instances): in the database and exactly once in read_committed.
    rows, records, problems = check_consistency(engine, cluster.bootstrap, cluster.topic, cluster.prefix, cluster.acks)
    lines = cluster.lines()
    acked = set(cluster.acks.ids())
    errors: dict[str, int] = {}
    for e in lines:
        if "error" in e:
            errors[e["error"]] = errors.get(e["error"], 0) + 1
    with TransactionAdmin({"bootstrap.servers": cluster.bootstrap}) as admin:
        still_open = [tid for tid in last.transactional_ids
                      if (info := admin.describe_transaction(tid)) is not None and info.is_open]
    if still_open:
        problems.append(f"transactions still open after recovery: {still_open}")
    assert not problems, problems
    assert rows == records
    assert_nothing_open(cluster.bootstrap, last.transactional_ids, topics=[cluster.topic])  # Kafka's own tool agrees
    return {"rows": rows, "acked": len(acked), "errors": errors, "final_settled": len(settled)}


def test_four_instances_with_random_kill_9(pg_url: str, kafka_bootstrap: str, tmp_path: Path, seed: int) -> None:
    engine = _engine(pg_url)
    prefix = f"chaos-{os.urandom(3).hex()}"
    cluster = Cluster(pg_url, kafka_bootstrap, create_topic(kafka_bootstrap, partitions=3), prefix, 16, tmp_path)
    rng = random.Random(seed)
    for _ in range(4):
        cluster.start()
    watcher = OpenWatcher(kafka_bootstrap, [f"{prefix}-{i}" for i in range(16)], cluster)
    kills = 0
    began = time.monotonic()
    live = list(cluster.procs)
    while time.monotonic() - began < CHAOS_S:
        time.sleep(rng.uniform(1.0, 3.0))  # the schedule of the kills, not a wait for anything
        victim = rng.choice(live)
        cluster.kill(victim)
        kills += 1
        live.remove(victim)
        live.append(cluster.start())
    # The last kill is aimed at an instance holding ids (a random victim may hold none: it died starting,
    # or the others held every id), and the survivors must settle each of them within the bound.
    deadline = time.monotonic() + 60
    while not (holders := sorted(name for name in live if _held_by(engine, prefix, cluster.owner(name)))):
        assert time.monotonic() < deadline, "no live instance held an id in 60 s"
        time.sleep(0.1)
    victim = rng.choice(holders)
    last_owner = cluster.owner(victim)
    cluster.kill(victim)
    killed_at = time.monotonic()
    kills += 1
    live.remove(victim)
    held = _held_by(engine, prefix, last_owner)
    assert held, f"{victim} held no id when it was killed"
    last_settled = _wait_settled(cluster, engine, prefix, last_owner, held, killed_at)
    longest = watcher.stop()
    assert last_settled is not None, "the last victim's ids were not settled within 30 s"
    assert last_settled <= OPEN_BOUND_S, f"the last victim's ids were settled {last_settled:.1f} s after its kill"
    summary = _finish(cluster, engine)
    print(f"\n{kills} kills, longest open transaction {longest:.2f} s less CPU waits ({watcher.longest}; "
          f"{watcher.longest_s:.2f} s by the wall clock), {summary}")
    assert kills >= 3
    assert summary["rows"] > 20
    assert longest <= OPEN_BOUND_S, f"a transaction stayed open {longest:.1f} s > {OPEN_BOUND_S:.1f} s"
    assert set(summary["errors"]) <= {"ProducerFencedError"}, summary["errors"]
    engine.dispose()


def test_scale_down_and_up(pg_url: str, kafka_bootstrap: str, tmp_path: Path) -> None:
    """One instance killed for good, one added: the dead one's ids are settled by the others within ~a lease."""
    engine = _engine(pg_url)
    prefix = f"scale-{os.urandom(3).hex()}"
    cluster = Cluster(pg_url, kafka_bootstrap, create_topic(kafka_bootstrap, partitions=2), prefix, 8, tmp_path)
    names = [cluster.start() for _ in range(3)]
    victim_owner = cluster.owner(names[0])
    watcher = OpenWatcher(kafka_bootstrap, [f"{prefix}-{i}" for i in range(8)], cluster)
    deadline = time.monotonic() + 60
    while not (held := _held_by(engine, prefix, victim_owner)) or not _acked(cluster, names[0]):
        assert time.monotonic() < deadline, "the victim held no id or committed nothing in 60 s"
        time.sleep(0.1)
    cluster.kill(names[0])
    killed_at = time.monotonic()
    cluster.start()  # scale-up, at the same moment
    settled_after = _wait_settled(cluster, engine, prefix, victim_owner, held, killed_at)
    longest = watcher.stop()
    summary = _finish(cluster, engine)
    print(f"\nscale-down: {len(held)} ids of the dead instance settled {settled_after} s after the kill "
          f"(less CPU waits); longest open transaction {longest:.2f} s less CPU waits; {summary}")
    assert settled_after is not None and settled_after <= OPEN_BOUND_S
    assert longest <= OPEN_BOUND_S
    engine.dispose()


def _held_by(engine: sa.Engine, prefix: str, owner: str) -> set[str]:
    return {lease.transactional_id for lease in _leases(engine, prefix) if lease.owner == owner}


def _acked(cluster: Cluster, name: str) -> bool:
    return any(e.get("worker") == name and "ok" in e for e in cluster.lines())


def _wait_settled(
    cluster: Cluster, engine: sa.Engine, prefix: str, owner: str, held: set[str], killed_at: float
) -> float | None:
    """Seconds after ``killed_at`` until every id in ``held`` has another owner and no open transaction.

    Less the most any live instance waited for a CPU meanwhile; ``None`` if that took longer than 30 s.
    """
    cpu_waits = CpuWaitLog()
    cpu_waits.sample(cluster.pids(), killed_at)
    with TransactionAdmin({"bootstrap.servers": cluster.bootstrap}) as admin:
        while time.monotonic() - killed_at < 30:
            leases = {lease.transactional_id: lease for lease in _leases(engine, prefix)}
            taken = all(leases[tid].owner != owner for tid in held)
            closed = all((info := admin.describe_transaction(tid)) is None or not info.is_open for tid in held)
            now = time.monotonic()
            cpu_waits.sample(cluster.pids(), now)
            if taken and closed:
                return now - killed_at - cpu_waits.waited_s(killed_at, now)
            time.sleep(0.1)
    return None


def _fenced_then_went_on(lines: list[dict[str, Any]], worker: str) -> bool:
    """``worker``'s stopped transaction failed, and a later one of ``worker`` was acknowledged."""
    stopped = next((e.get("rid") for e in lines if e.get("fault") == "stop_at" and e["worker"] == worker), None)
    failed = next((i for i, e in enumerate(lines) if stopped is not None and e.get("id") == stopped), None)
    return failed is not None and any(e.get("worker") == worker and "ok" in e for e in lines[failed:])


def _leases(engine: sa.Engine, prefix: str) -> list[sa.Row[Any]]:
    t = define_lease_table(sa.MetaData())
    with engine.connect() as conn:
        return list(conn.execute(sa.select(t.c.transactional_id, t.c.owner, t.c.epoch).where(t.c.pool == prefix)))


@pytest.mark.parametrize("step", ["produced", "prepared", "state_stored"])
def test_a_paused_instance_whose_lease_was_taken_is_fenced_and_commits_nothing(
    pg_url: str, kafka_bootstrap: str, tmp_path: Path, step: str
) -> None:
    engine = _engine(pg_url)
    prefix = f"zombie-{step}-{os.urandom(3).hex()}"
    cluster = Cluster(pg_url, kafka_bootstrap, create_topic(kafka_bootstrap), prefix, 3, tmp_path, threads=1)
    name = cluster.start(stop_at=step, after=2, fault_when_open=step == "produced")
    zombie_owner = cluster.owner(name)
    deadline = time.monotonic() + 60
    while not any(e.get("fault") == "stop_at" for e in cluster.lines()):
        assert time.monotonic() < deadline, "the worker never reached its stop point"
        time.sleep(0.1)
    (stopped_id,) = [lease[0] for lease in _leases(engine, prefix) if lease[1] == zombie_owner]
    # Another instance takes the id over once the lease expired (its orphan scan).
    other = WriterPool(engine, {"bootstrap.servers": kafka_bootstrap}, prefix=prefix, size=3, lease_s=LEASE_S)
    try:
        while not any(lease[0] == stopped_id and lease[1] == other.owner for lease in _leases(engine, prefix)):
            assert time.monotonic() < deadline, "the paused instance's id was not taken over"
            time.sleep(0.1)
        with TransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:  # the takeover aborts the paused one
            while (info := admin.describe_transaction(stopped_id)) is not None and info.is_open:
                assert time.monotonic() < deadline, f"the paused instance's transaction is still open: {info}"
                time.sleep(0.1)
        while stopped_id not in other.held_ids:  # its recovery finished: the id is a slot of the other instance
            assert time.monotonic() < deadline, "the other instance did not finish the takeover"
            time.sleep(0.05)
        cluster.procs[name].send_signal(signal.SIGCONT)
        while not _fenced_then_went_on(cluster.lines(), name):  # the zombie finds out, and goes on with other ids
            assert time.monotonic() < deadline + 60, "the continued instance neither failed nor went on"
            time.sleep(0.05)
        other_rid = f"{prefix}:other"
        items = items_table(sa.MetaData())
        with engine.connect() as conn, other.transaction(conn) as tx:
            tx.produce(cluster.topic, value=other_rid.encode())
            conn.execute(items.insert().values(id=other_rid, series=prefix))
    finally:
        other.close()
    summary = _finish(cluster, engine)
    lines = cluster.lines()
    # The transaction the stop hit: the third that reached the step (an earlier one may have failed and retried).
    (paused_rid,) = [e["rid"] for e in lines if e.get("fault") == "stop_at"]
    assert paused_rid is not None and paused_rid.startswith(f"{prefix}:{name}:0:"), lines
    errors = [e for e in lines if e.get("id") == paused_rid]
    assert [e["error"] for e in errors] == ["ProducerFencedError"], lines
    with engine.connect() as conn:
        assert conn.execute(sa.select(items.c.id).where(items.c.id == paused_rid)).first() is None
    closed = [e for e in lines if e.get("closed")]
    assert closed and closed[0]["metrics"]["leases_lost"] >= 1
    assert summary["acked"] > 3, "the zombie went on working with another id after it was fenced"
    print(f"\nzombie at {step}: {summary}")
    engine.dispose()
