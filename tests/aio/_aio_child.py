"""An asyncio dual-writing process for the crash tests: SQLite + Kafka through AsyncTwoPhaseCommitProducer.

Run as a real subprocess so that the parent can ``kill -9`` it at a known step
(or at a random moment).  KIP-939's recipe: prepare the Kafka transaction,
store its state in the same database transaction as the rows, commit the
database (the decision point), then commit Kafka.

Usage::

    _aio_child.py BOOTSTRAP TOPIC TRANSACTIONAL_ID DB_PATH STEP...

Steps run in order; each prints one marker line (flushed) when done:

``commit:N``     a full transaction of N records          -> ``COMMITTED <state>``
``stored:N``     prepare N records, store + commit the DB  -> ``STORED <state>``
``prepared:N``   prepare N records, do not store            -> ``PREPARED <state>``
``open:N``       produce and flush N records, no prepare    -> ``OPEN``
``loop:N[:MS[:K]]``  full transactions of N records, forever (or K of them,
                 then the next step) -> ``COMMITTED <state>`` each (waiting MS
                 milliseconds between the database COMMIT and Kafka's, as a
                 service doing other work there would: widens the window a
                 random kill lands in)

Record values are ``<txn>-<i>``; ``txn`` continues after the highest one in
the database, so values stay unique across restarts.  Every value of a
transaction whose Kafka commit returned (``commit``, ``loop``) is appended and
fsynced to ``$KAFKA2PC_ACK_LOG`` (``harness.acks``) before its marker.  After the steps it
prints ``READY`` and waits to be killed.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import traceback

from harness.acks import AckLog  # tests/ is on its PYTHONPATH (harness.procs)

from kafka2pc import PreparedTxnState
from kafka2pc.aio import AsyncTwoPhaseCommitProducer

SCHEMA = """
CREATE TABLE IF NOT EXISTS rows (txn INTEGER NOT NULL, value TEXT NOT NULL PRIMARY KEY);
CREATE TABLE IF NOT EXISTS kafka_txn_state (transactional_id TEXT PRIMARY KEY, state TEXT NOT NULL);
"""


def say(line: str) -> None:
    print(line, flush=True)


class Writer:
    def __init__(self, bootstrap: str, topic: str, tid: str, db_path: str) -> None:
        self.topic, self.tid = topic, tid
        self.db = sqlite3.connect(db_path, isolation_level=None)
        self.db.executescript(SCHEMA)
        (last,) = self.db.execute("SELECT COALESCE(MAX(txn), -1) FROM rows").fetchone()
        self.txn = int(last) + 1
        self.values: list[str] = []
        self.acks = AckLog.from_env()
        self.producer = AsyncTwoPhaseCommitProducer(
            {"bootstrap.servers": bootstrap, "transactional.id": tid, "linger.ms": 5}
        )

    async def open(self, n: int) -> None:
        self.values = [f"{self.txn}-{i}" for i in range(n)]
        await self.producer.begin_transaction()
        for value in self.values:
            await self.producer.produce(self.topic, key=value.encode(), value=value.encode())
        await self.producer.flush(30)

    async def prepare(self, n: int) -> PreparedTxnState:
        await self.open(n)
        return await self.producer.prepare_transaction(30)

    def store(self, state: PreparedTxnState) -> None:
        # SQLite on a local file: a millisecond; the service under test is the producer.
        self.db.execute("BEGIN IMMEDIATE")
        self.db.executemany("INSERT INTO rows VALUES (?, ?)", [(self.txn, v) for v in self.values])
        self.db.execute(
            "INSERT INTO kafka_txn_state VALUES (?, ?) "
            "ON CONFLICT(transactional_id) DO UPDATE SET state = excluded.state",
            (self.tid, str(state)),
        )
        self.db.execute("COMMIT")

    async def full(self, n: int, pause_ms: int = 0) -> PreparedTxnState:
        state = await self.prepare(n)
        self.store(state)
        if pause_ms:
            await asyncio.sleep(pause_ms / 1000)
        await self.producer.commit_transaction(30)
        if self.acks is not None:  # acknowledged: both sides committed
            for value in self.values:
                self.acks.record(value)
        self.txn += 1
        return state

    async def step(self, step: str) -> None:
        kind, _, rest = step.partition(":")
        count, _, rest = rest.partition(":")
        pause, _, times = rest.partition(":")
        n = int(count or 0)
        if kind == "commit":
            say(f"COMMITTED {await self.full(n)}")
        elif kind == "stored":
            state = await self.prepare(n)
            self.store(state)
            say(f"STORED {state}")
        elif kind == "prepared":
            say(f"PREPARED {await self.prepare(n)}")
        elif kind == "open":
            await self.open(n)
            say("OPEN")
        elif kind == "loop":
            remaining = int(times) if times else -1
            while remaining != 0:
                say(f"COMMITTED {await self.full(n, int(pause or 0))}")
                remaining -= 1
        else:
            raise SystemExit(f"unknown step {step!r}")


async def main(argv: list[str]) -> int:
    bootstrap, topic, tid, db_path, *steps = argv
    try:
        writer = Writer(bootstrap, topic, tid, db_path)
        await writer.producer.init_transactions(60)
        say("INIT")
        for step in steps:
            await writer.step(step)
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
        say("CRASHED " + traceback.format_exc().replace("\n", " | "))
        return 1
    say("READY")
    await asyncio.Event().wait()  # until killed
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
