"""The FastAPI example service over real HTTP, ``kill -9``-ed at random moments under load.

``examples/fastapi_orders.py`` runs under uvicorn as a child process (4
writers, 4 transactional ids) on PostgreSQL or SQLite and a real broker.
An httpx client keeps ``CONCURRENCY`` (64) requests in flight; each
``POST /orders`` carries a fresh order id and a request id that the event
echoes, and every 15th request re-sends the id of an order that already got
its 201 (the duplicate must be refused and its event never seen).  The
server is killed with SIGKILL ``KILLS`` times at random moments (0.3-2 s
after it came up), restarted each time, and its lifespan recovers the four
ids before it accepts requests.  At the end (one more start, a graceful
stop) the test reads the database and a ``read_committed`` consumer:

* every 2xx answer: the order's row and exactly one visible event, and that
  event is this request's;
* every failed request (connection dropped by the kill, 5xx): row and event
  both there or both missing (recovery made them agree);
* every refused duplicate (409): its event is never visible;
* I1-I5: every row has exactly one visible event and every event its row
  (I1, I2, I3), no event of a rolled-back request (I4), and the
  ``read_committed`` end offset equals the ``read_uncommitted`` one (I5).

Every 201 is acknowledged (the client appends the order id to an
acknowledged-write log, ``harness.acks``, checked id by id against the rows
and the ``read_committed`` events). The test requires that a kill hit
requests in flight (some were dropped) and that a restarted server's
recovery decided something (committed or aborted a transaction a kill left
open): while either has not happened after ``KAFKA2PC_HTTP_KILLS`` kills, it
kills again, up to three times as many. The kills' moments and the
duplicates are drawn from the test's seed (``$KAFKA2PC_SEED``, printed).

``KAFKA2PC_HTTP_KILLS`` (default 4, for CI; the full run uses 30) and
``KAFKA2PC_HTTP_CONCURRENCY`` (default 64) size it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from harness.acks import AckLog, assert_acknowledged
from harness.kafka_judge import assert_nothing_open
from harness.procs import REPO

from kafka2pc.testing import create_topic, drain, end_offsets
from kafka2pc.testing.broker import port_base

KILLS = int(os.environ.get("KAFKA2PC_HTTP_KILLS", "4"))
CONCURRENCY = int(os.environ.get("KAFKA2PC_HTTP_CONCURRENCY", "64"))
WRITERS = 4
EXAMPLES = REPO / "examples"


@dataclass
class Outcomes:
    """What the client saw, per request id."""

    acks: AckLog
    order_of: dict[str, str] = field(default_factory=dict)
    status: dict[str, int | str] = field(default_factory=dict)
    duplicates: set[str] = field(default_factory=set)

    def dropped(self) -> int:
        """Requests that failed without an answer (the connection died with the server)."""
        return sum(isinstance(s, str) for s in self.status.values())

    def counts(self) -> Counter[str]:
        return Counter(
            "2xx" if isinstance(s, int) and s < 300 else "409" if s == 409
            else f"http {s}" if isinstance(s, int) else "dropped"
            for s in self.status.values()
        )


class Server:
    """``uvicorn fastapi_orders:app`` as a child process; killed and restarted by the test."""

    def __init__(self, env: dict[str, str], port: int, log: Path) -> None:
        self.env, self.port, self.log_path = env, port, log
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, client: httpx.AsyncClient, timeout: float = 90.0) -> float:
        """Start the server and wait until it answers (its lifespan recovery ran); return the seconds it took."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        with open(self.log_path, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "uvicorn", "fastapi_orders:app", "--app-dir", str(EXAMPLES),
                "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "info", "--no-access-log",
                env={**os.environ, **self.env}, stdout=log, stderr=log,
            )
        self.starts += 1
        while loop.time() - started < timeout:
            if self.proc.returncode is not None:
                pytest.fail(f"the server exited {self.proc.returncode} at start {self.starts}:\n{self.log_tail()}")
            try:
                if (await client.get(f"{self.url}/health", timeout=2)).status_code == 200:
                    return loop.time() - started
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
        pytest.fail(f"the server did not come up in {timeout}s:\n{self.log_tail()}")

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        assert await self.proc.wait() == -signal.SIGKILL

    async def stop(self) -> None:
        """Graceful stop (SIGTERM): the lifespan closes the writers."""
        assert self.proc is not None
        size = self.log_path.stat().st_size
        self.proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(self.proc.wait(), 60)
        # uvicorn re-raises the signal it shut down on (exit by SIGTERM) once the lifespan ended.
        assert code in (0, -signal.SIGTERM), self.log_tail()
        with open(self.log_path, "rb") as log:
            log.seek(size)
            assert b"Application shutdown complete" in log.read(), self.log_tail()

    def log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])


async def drive(server: Server, kills: int, outcomes: Outcomes, rng: random.Random) -> list[float]:
    """Keep CONCURRENCY requests in flight while killing and restarting the server ``kills`` times, more (up to
    three times as many) until a kill dropped requests in flight and a recovery decided something."""
    up = asyncio.Event()
    done = asyncio.Event()
    committed: list[str] = []  # order ids that got a 201, re-sent as duplicates
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)

    sent = 0

    async def client_task(client: httpx.AsyncClient, worker: int) -> None:
        nonlocal sent
        n = 0
        while not done.is_set():
            await up.wait()
            n += 1
            sent += 1
            request_id = f"r{worker}-{n}-{uuid.uuid4().hex[:6]}"
            if committed and sent % 15 == 0:
                order_id = rng.choice(committed)
                outcomes.duplicates.add(request_id)
            else:
                order_id = f"o{worker}-{n}-{uuid.uuid4().hex[:6]}"
            outcomes.order_of[request_id] = order_id
            body = {"id": order_id, "item": "book", "quantity": 1 + n % 3, "request_id": request_id}
            try:
                response = await client.post(f"{server.url}/orders", json=body, timeout=60)
                outcomes.status[request_id] = response.status_code
                if response.status_code == 201:
                    outcomes.acks.record(order_id)  # acknowledged to the client
                if response.status_code == 201 and request_id not in outcomes.duplicates:
                    committed.append(order_id)
            except httpx.HTTPError as exc:
                outcomes.status[request_id] = type(exc).__name__

    start_times: list[float] = []
    async with httpx.AsyncClient(limits=limits) as client:
        start_times.append(await server.start(client))
        up.set()
        tasks = [asyncio.ensure_future(client_task(client, w)) for w in range(CONCURRENCY)]
        killed = 0
        while killed < kills or (not (outcomes.dropped() and recovery_decisions(server.log_path))
                                 and killed < 3 * kills):
            killed += 1
            await asyncio.sleep(rng.uniform(0.3, 2.0))  # when the kill comes (drawn), not a wait for anything
            up.clear()  # new requests wait for the restart; those in flight die with the server
            await server.kill()
            start_times.append(await server.start(client))
            up.set()
        await asyncio.sleep(rng.uniform(0.3, 2.0))
        done.set()
        await asyncio.gather(*tasks)  # the last requests finish against a live server
        await server.stop()
        # One more start and stop: its recovery finds nothing left to settle.
        start_times.append(await server.start(client))
        await server.stop()
    return start_times


def check(url: str, bootstrap: str, topic: str, outcomes: Outcomes) -> dict[str, Any]:
    """The invariants; returns the figures."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = set(conn.execute(sa.text("SELECT id FROM orders")).scalars())
    finally:
        engine.dispose()
    events: dict[str, list[str]] = defaultdict(list)
    for record in drain(bootstrap, topic, "read_committed"):
        assert record.value is not None
        event = json.loads(record.value)
        assert record.key is not None and record.key.decode() == event["id"]
        events[event["id"]].append(event["request_id"])
    problems: list[str] = []
    # I1, I2, I3: every row has exactly one visible event, every visible event has its row.
    for order_id in rows | set(events):
        seen = events.get(order_id, [])
        if order_id not in rows or len(seen) != 1:
            problems.append(f"order {order_id}: row={order_id in rows}, events={seen}")
    # I5: nothing left hanging once recovery ran.
    committed_end, uncommitted_end = end_offsets(bootstrap, topic, "read_committed"), end_offsets(bootstrap, topic)
    if committed_end != uncommitted_end:
        problems.append(f"transaction left hanging: {committed_end} != {uncommitted_end}")
    # Every acknowledged order (201): its row and exactly one read_committed event.
    acknowledged = assert_acknowledged(outcomes.acks, rows, [order for order, seen in events.items() for _ in seen])
    visible = {request_id for seen in events.values() for request_id in seen}
    failed_agreeing = Counter[str]()
    for request_id, status in outcomes.status.items():
        order_id = outcomes.order_of[request_id]
        if isinstance(status, int) and 200 <= status < 300:
            if order_id not in rows or events.get(order_id) != [request_id]:
                problems.append(f"{request_id} got {status}: row={order_id in rows}, events={events.get(order_id)}")
        elif status == 409:
            if request_id in visible:  # I4: the refused duplicate rolled back on both sides
                problems.append(f"{request_id} was refused (409) but its event is visible")
        elif request_id not in outcomes.duplicates:
            # A failed request (dropped by a kill, or 5xx): both sides or neither.
            both = order_id in rows and events.get(order_id) == [request_id]
            neither = order_id not in rows and request_id not in visible
            if not (both or neither):
                problems.append(f"{request_id} failed ({status}): row={order_id in rows}, "
                                f"events={events.get(order_id)}")
            failed_agreeing["kept by recovery" if both else "neither"] += 1
    assert not problems, "\n".join(problems[:20]) + f"\n({len(problems)} problems)"
    return {"rows": len(rows), "events": sum(len(v) for v in events.values()), "acknowledged": acknowledged,
            **failed_agreeing}


def recovery_decisions(log: Path) -> Counter[str]:
    """The non-trivial recovery decisions the restarted servers logged."""
    decisions = Counter[str]()
    for line in log.read_text(errors="replace").splitlines():
        if "recovered the previous transaction:" in line:
            decisions[line.rsplit(":", 1)[1].strip()] += 1
    return decisions


@pytest.mark.parametrize("db_kind", [
    "postgresql",
    pytest.param("sqlite", marks=pytest.mark.campaign),  # about 65 s; SQLite's kill points are the crash matrix's
])
def test_fastapi_service_killed_under_load_keeps_rows_and_events_equal(
    db_kind: str, request: pytest.FixtureRequest, kafka_bootstrap: str, tmp_path: Path, seed: int
) -> None:
    url = str(request.getfixturevalue("pg_url")) if db_kind == "postgresql" else f"sqlite:///{tmp_path / 'orders.db'}"
    async_url = url.replace("sqlite://", "sqlite+aiosqlite://", 1) if db_kind == "sqlite" else url
    topic = create_topic(kafka_bootstrap, partitions=3)
    env = {
        "ORDERS_DATABASE_URL": async_url, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "ORDERS_TOPIC": topic,
        "ORDERS_TRANSACTIONAL_ID": (tid_prefix := f"orders-http-{uuid.uuid4().hex[:8]}"), "ORDERS_WRITERS": str(WRITERS),
        "ORDERS_KAFKA_TIMEOUT_S": "30",
    }
    port = port_base() + 1850 + (0 if db_kind == "postgresql" else 1)  # free in every test's block
    server = Server(env, port, tmp_path / "server.log")
    outcomes = Outcomes(AckLog(tmp_path / "acks"))
    rng = random.Random(seed)
    start_times = asyncio.run(drive(server, KILLS, outcomes, rng))
    figures = check(url, kafka_bootstrap, topic, outcomes)
    decisions = recovery_decisions(server.log_path)
    counts = outcomes.counts()
    kills = server.starts - 2
    print(f"\n{db_kind}: {kills} kills, {server.starts} starts (start + recovery {min(start_times):.1f}-"
          f"{max(start_times):.1f} s), {len(outcomes.status)} requests: {dict(counts)}; "
          f"failed requests: {dict((k, v) for k, v in figures.items() if k not in ('rows', 'events', 'acknowledged'))}; "
          f"rows {figures['rows']} = events {figures['events']}; recovery decisions {dict(decisions)}")
    assert KILLS <= kills <= 3 * KILLS
    assert counts["2xx"] > 0 and counts["409"] > 0
    assert counts["dropped"] > 0, "no kill hit a request in flight"
    assert sum(decisions.values()) > 0, "no recovery decided anything: no kill left a transaction open"
    assert figures["rows"] == figures["events"] >= counts["2xx"]
    assert figures["acknowledged"] == counts["2xx"]
    verdict = assert_nothing_open(kafka_bootstrap, prefix=tid_prefix, topics=[topic])  # Kafka's own tool agrees
    assert len(verdict.states) == WRITERS, verdict.states
