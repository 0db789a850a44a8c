"""``examples/django_orders`` under gunicorn (4 workers) behind HTTP: workers SIGKILLed, the broker stopped.

The order service runs as the example says (``manage.py migrate``, then ``gunicorn -c gunicorn.conf.py``)
on PostgreSQL and a private broker.  Clients keep requests in flight throughout; two workers are
killed with SIGKILL, 2 s apart, while requests are in flight (gunicorn starts new ones, which recover
at their start), then the broker is stopped (SIGSTOP) for 10 s.  Every request ends within the example's documented
bound (``ACQUIRE_TIMEOUT_S + 2 * KAFKA_TIMEOUT_S``, plus slack for a loaded machine) with 201, 503, or a
connection dropped by the kill; writes succeed again once the broker is back; after a graceful stop
and ``manage.py kafka2pc_recover``, the order rows equal the ``read_committed`` events, every 201 among
them, and nothing is left open.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from harness.acks import assert_acknowledged
from harness.brokers import frozen
from harness.ports import OTHER_RANGES, private_broker

from kafka2pc.testing import create_topic, drain, end_offsets, settled_end_offsets
from kafka2pc.testing.broker import port_base

pytestmark = pytest.mark.quiet  # wall-clock bounds: scripts/test.sh runs it alone

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "django_orders"
KAFKA_TIMEOUT_S = 2.0
ACQUIRE_TIMEOUT_S = 3.0
LEASE_S = 4.0
BOUND_S = ACQUIRE_TIMEOUT_S + 2 * KAFKA_TIMEOUT_S
SLACK_S = 4.0
"""Allowance for a loaded 2-core machine on top of the documented bound."""
CLIENTS = 8
OUTAGE_S = 10.0


def _workers(master: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == master:
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize("pipelined", [
    pytest.param(False, id="serial", marks=pytest.mark.campaign),  # about 55 s alone; CI runs the pipelined pool
    pytest.param(True, id="pipelined"),
])
def test_gunicorn_workers_killed_and_broker_stopped_keep_rows_and_events_equal(
    pg_url: str, tmp_path: Path, pipelined: bool
) -> None:
    """Pipelined too (``ORDERS_PIPELINED=1``): a 201 is sent at the database COMMIT, and the kills and the
    outage land on Kafka commits in flight as well; the same bounds and end state hold."""
    db = sa.make_url(pg_url)
    series = uuid.uuid4().hex[:8]
    port = port_base() + OTHER_RANGES["django/test_django_orders_http gunicorn"][0]
    with private_broker("django/test_django_orders_http") as kafka:
        bootstrap = kafka.bootstrap_servers
        topic = create_topic(bootstrap, partitions=2)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")]),
            "DJANGO_SETTINGS_MODULE": "orders_project.settings",
            "ORDERS_DB": f"postgresql://{db.username}:{db.password}@{db.host}:{db.port}/{db.database}",
            "KAFKA_BOOTSTRAP_SERVERS": bootstrap, "ORDERS_TOPIC": topic,
            "ORDERS_TRANSACTIONAL_ID_PREFIX": f"orders-{series}", "ORDERS_POOL_SIZE": "24",
            "ORDERS_KAFKA_TIMEOUT_S": str(KAFKA_TIMEOUT_S), "ORDERS_ACQUIRE_TIMEOUT_S": str(ACQUIRE_TIMEOUT_S),
            "ORDERS_LEASE_S": str(LEASE_S), "ORDERS_BIND": f"127.0.0.1:{port}", "ORDERS_WORKERS": "4",
            "ORDERS_PIPELINED": "1" if pipelined else "",
        }
        manage = [sys.executable, "manage.py"]
        subprocess.run([*manage, "migrate", "-v", "0"], cwd=EXAMPLE, env=env, check=True, timeout=120)
        log = open(tmp_path / "gunicorn.log", "ab")  # noqa: SIM115 - closed below
        server = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "orders_project.wsgi"],
                                  cwd=EXAMPLE, env=env, stdout=log, stderr=log)
        url = f"http://127.0.0.1:{port}"
        statuses: Counter[str] = Counter()
        latencies: list[tuple[float, str, float]] = []  # (when, outcome, seconds)
        acked: list[str] = []
        stop = threading.Event()
        lock = threading.Lock()
        t0 = time.monotonic()

        def client(n: int) -> None:
            with httpx.Client(timeout=BOUND_S + 30) as http:
                i = 0
                while not stop.is_set():
                    i += 1
                    oid = f"{series}-{n}-{i}"
                    started = time.monotonic()
                    try:
                        status = str(http.post(f"{url}/orders", json={"id": oid, "item": "book", "quantity": 1})
                                     .status_code)
                    except httpx.TimeoutException:
                        status = "timeout"
                    except httpx.TransportError:
                        status = "dropped"
                        time.sleep(0.05)
                    took = time.monotonic() - started
                    with lock:
                        statuses[status] += 1
                        latencies.append((started - t0, status, took))
                        if status == "201":
                            acked.append(oid)

        try:
            deadline = time.monotonic() + 90
            while True:
                assert server.poll() is None, (tmp_path / "gunicorn.log").read_text()[-4000:]
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "gunicorn did not come up"
                time.sleep(0.1)
            threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(CLIENTS)]
            for t in threads:
                t.start()
            # A fresh broker's transaction coordinator may still be loading (503s): the kills come once writes flow.
            flowing_by = time.monotonic() + 60
            while statuses["201"] == 0 and time.monotonic() < flowing_by:
                time.sleep(0.1)
            time.sleep(4)
            before_kill = statuses["201"]
            first = _workers(server.pid)[0]
            os.kill(first, signal.SIGKILL)  # requests in flight on it are dropped
            time.sleep(2)
            second = next(pid for pid in _workers(server.pid) if pid != first)
            os.kill(second, signal.SIGKILL)  # a second one while gunicorn replaces the first
            time.sleep(4)
            with frozen(kafka):  # the broker stopped for 10 s
                outage_start = time.monotonic() - t0
                time.sleep(OUTAGE_S)
            healed_by = time.monotonic() + 90
            ok_at_outage_end = statuses["201"]
            while statuses["201"] < ok_at_outage_end + 20:
                assert time.monotonic() < healed_by, f"no writes succeed after the outage: {dict(statuses)}"
                time.sleep(0.2)
            stop.set()
            for t in threads:
                t.join(BOUND_S + 40)
        finally:
            stop.set()
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()
        print(f"\nrequests: {dict(statuses)}; 201 before the kill: {before_kill}; outage from {outage_start:.1f} s; "
              f"longest {max(t for _, _, t in latencies):.2f} s (bound {BOUND_S} s)")
        assert before_kill > 0 and statuses["201"] > before_kill
        late = [(round(w, 1), s, round(t, 2)) for w, s, t in latencies if t > BOUND_S + SLACK_S]
        assert not late, f"requests past the bound: {late[:10]}"
        assert statuses["timeout"] == 0
        assert set(statuses) <= {"201", "503", "dropped"}, dict(statuses)
        # Whatever the killed worker left is settled (by the survivors' orphan scans, or here).
        settle = subprocess.run([*manage, "kafka2pc_recover", "--wait", str(LEASE_S + 10)], cwd=EXAMPLE, env=env,
                                capture_output=True, text=True, timeout=180)
        assert settle.returncode == 0, settle.stdout + settle.stderr
        engine = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            rows = set(conn.execute(sa.text("SELECT id FROM orders_order WHERE id LIKE :p"),
                                    {"p": f"{series}-%"}).scalars())
        engine.dispose()
        records = [r.key.decode() for r in drain(bootstrap, topic, "read_committed") if r.key]
        assert len(records) == len(set(records)), "duplicated events"
        assert rows == set(records), (sorted(rows - set(records))[:5], sorted(set(records) - rows)[:5])
        assert_acknowledged(acked, rows, records)
        assert settled_end_offsets(bootstrap, topic) == end_offsets(bootstrap, topic, "read_uncommitted")
