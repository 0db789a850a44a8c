"""A dual write in a real Celery worker (prefork, 2 processes), with its child processes killed mid-task.

The worker runs ``examples/celery_orders.py`` as its docs say to run it: Redis (Debian's ``redis-server``,
started here on a port of the test's block) is Celery's broker and result backend, the main process
creates the tables before it forks, and each child process makes its own ``WriterPool`` in
``worker_process_init``.  While the children work through the queue, some are killed with SIGKILL at moments
drawn from the test's seed; Celery's main process starts new ones, and ``acks_late`` with
``task_reject_on_worker_lost`` runs each killed task again.

Checked at the end: every task succeeded; its order is in the database and has exactly one
``read_committed`` event, and vice versa; the ``read_committed`` end offset equals the high watermark; and
Kafka's own ``TransactionsCommand`` finds none of the pool's ids open, once the orphan scans of the live
children settled what the killed ones left (within a lease plus a scan, bounded here).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from harness.kafka_judge import assert_nothing_open
from harness.ports import is_closed
from harness.procs import REPO, child_env

from kafka2pc.testing import drain, end_offsets, settled_end_offsets
from kafka2pc.testing.broker import port_base
from kafka2pc.testing.postgres import fresh_database

TASKS = 120
KILLS = 3
LEASE_S = 2.0
#: A killed child's open transaction is settled by a live child's scan within a lease plus a scan (a third
#: of the lease, jittered up to 1.2x) plus the recovery; the rest is slack for a loaded 2-core machine.
SETTLE_BOUND_S = LEASE_S + 1.2 * LEASE_S / 3 + 20.0
REDIS_PORT_OFFSET = 1870  # harness.ports.OTHER_RANGES


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Celery's main process: its pool's workers)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
    return [int(p) for p in out.split()]


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A throw-away Redis on the test's port, no persistence; stopped after the test."""
    server = shutil.which("redis-server")
    assert server, "redis-server is missing: scripts/test.sh installs it (apt-get install redis-server)"
    port = port_base() + REDIS_PORT_OFFSET
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while is_closed(port):
            assert proc.poll() is None, f"redis-server exited {proc.returncode} (port {port} taken?)"
            assert time.monotonic() < deadline, "redis-server did not listen within 20 s"
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def orders_url() -> Iterator[str]:
    """A PostgreSQL database of the test's own: the example's ``orders`` table is the example's name, which the
    session's shared database may hold for another test."""
    with fresh_database() as url:
        yield url


def test_celery_prefork_worker_killed_mid_task_keeps_each_order_once(
    redis_url: str, orders_url: str, kafka_bootstrap: str, topic_factory, tmp_path: Path, seed: int,
) -> None:
    from celery import Celery

    rng = random.Random(seed)
    topic = topic_factory(partitions=3)
    prefix = f"celery-{tmp_path.name[-24:]}"
    env = child_env(ORDERS_DATABASE_URL=orders_url, KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap, CELERY_BROKER_URL=redis_url,
                    ORDERS_TOPIC=topic, ORDERS_POOL_PREFIX=prefix, ORDERS_POOL_SIZE="8", ORDERS_LEASE_S=str(LEASE_S))
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "--workdir", str(REPO / "examples"), "-A", "celery_orders", "worker",
             "--pool=prefork", "--concurrency=2", "--loglevel=INFO", "--without-gossip", "--without-mingle",
             "--without-heartbeat"], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    client = Celery("client", broker=redis_url, backend=redis_url)
    client.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
    killed: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(_children(worker.pid)) < 2 or "ready." not in log.read_text():
            assert worker.poll() is None, f"the worker exited {worker.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the worker was not ready in 60 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        ids = [f"o-{n}" for n in range(TASKS)]
        results = [client.send_task("celery_orders.place_order", args=(oid, "book", 1 + n % 3))
                   for n, oid in enumerate(ids)]
        # Kill a busy child KILLS times, at moments drawn from the seed, while the queue is still long.
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.3, 1.5))
            children = _children(worker.pid)
            assert children, f"the worker has no child process:\n{log.read_text()[-3000:]}"
            victim = rng.choice(children)
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
        outcomes = Counter(r.get(timeout=180, propagate=True) for r in results)
        assert sum(outcomes.values()) == TASKS, outcomes
        # Every order once in the database and once among the read_committed events, and nothing else.
        engine = sa.create_engine(orders_url)
        try:
            with engine.connect() as conn:
                rows = set(conn.execute(sa.text("SELECT id FROM orders")).scalars())
        finally:
            engine.dispose()
        assert rows == set(ids), f"orders missing: {sorted(set(ids) - rows)[:5]}, extra: {sorted(rows - set(ids))[:5]}"
        # A killed child's open transaction holds the read_committed end back until a live child settles it.
        settle_deadline = time.monotonic() + SETTLE_BOUND_S
        while settled_end_offsets(kafka_bootstrap, topic) != end_offsets(kafka_bootstrap, topic, "read_uncommitted"):
            assert time.monotonic() < settle_deadline, (
                f"a transaction of a killed child stayed open longer than {SETTLE_BOUND_S:.0f} s")
            time.sleep(0.5)
        events = Counter(json.loads(r.value)["id"] for r in drain(kafka_bootstrap, topic, "read_committed") if r.value)
        duplicated = sorted(k for k, n in events.items() if n > 1)
        assert not duplicated, f"orders with more than one event: {duplicated[:5]}"
        assert set(events) == rows, (f"orders without an event: {sorted(rows - set(events))[:5]}, "
                                     f"events without an order: {sorted(set(events) - rows)[:5]}")
        print(f"{TASKS} tasks ({dict(outcomes)}), {len(killed)} children killed: rows = events = {len(rows)}")
    finally:
        worker.send_signal(signal.SIGTERM)  # warm shutdown: the children close their pools
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)
    assert worker.returncode == 0, f"the worker exited {worker.returncode}:\n{log.read_text()[-3000:]}"
    assert_nothing_open(kafka_bootstrap, prefix=f"{prefix}-", topics=[topic])
