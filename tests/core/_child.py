"""A dual-writing process for the crash tests: SQLite + Kafka through TwoPhaseCommitProducer.

Run by ``tests/core/conftest.py`` as a real subprocess so that the parent can
``kill -9`` (or SIGSTOP) it at a known step.  It follows KIP-939's recipe:
prepare the Kafka transaction, store its state *in the same database
transaction* as the data, commit the database (the decision point), then
commit Kafka.

Usage::

    _child.py BOOTSTRAP TOPIC TRANSACTIONAL_ID DB_PATH [--timeout-ms N] [--group G] STEP...

Steps run in order; each prints one marker line (flushed) when done:

``commit:N``     a full transaction of N records           -> ``COMMITTED <state>``
``stored:N``     prepare N records, store + commit the DB   -> ``STORED <state>``
``prepared:N``   prepare N records, do not store             -> ``PREPARED <state>``
``open:N``       produce and flush N records, no prepare     -> ``OPEN``

``N@P`` (with ``--group G``) also sends consumer offsets: TOPIC partition 0 at
position P for group G (``commit:0@5`` is an offsets-only transaction,
``commit:0`` an empty one); the database stores P with the transaction.

Record values are ``<txn>-<i>`` with ``txn`` counting transactions from 0.
Then it prints ``READY`` and serves commands read from stdin, one per line,
answering ``OK <detail>`` or ``ERROR <ExceptionClass> <message>``:
``commit``, ``produce:N``, ``prepare``, ``exit``.
"""

from __future__ import annotations

import sqlite3
import sys
import traceback

from kafka2pc import PreparedTxnState, TwoPhaseCommitProducer

SCHEMA = """
CREATE TABLE IF NOT EXISTS rows (txn INTEGER NOT NULL, value TEXT NOT NULL PRIMARY KEY);
CREATE TABLE IF NOT EXISTS kafka_txn_state (transactional_id TEXT PRIMARY KEY, state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS positions (txn INTEGER NOT NULL, position INTEGER NOT NULL);
"""


def say(line: str) -> None:
    print(line, flush=True)


class Writer:
    def __init__(
        self, bootstrap: str, topic: str, tid: str, db_path: str, timeout_ms: int | None, group: str | None = None
    ) -> None:
        config: dict[str, object] = {"bootstrap.servers": bootstrap, "transactional.id": tid, "linger.ms": 5}
        if timeout_ms is not None:
            config["transaction.timeout.ms"] = timeout_ms
        self.topic, self.tid = topic, tid
        self.db = sqlite3.connect(db_path, isolation_level=None)
        self.db.executescript(SCHEMA)
        self.producer = TwoPhaseCommitProducer(config)
        self.producer.init_transactions()
        self.txn = 0
        self.values: list[str] = []
        self.position: int | None = None
        self.group_metadata = None
        if group is not None:
            from confluent_kafka import Consumer

            self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
            self.group_metadata = self.consumer.consumer_group_metadata()

    def produce(self, n: int) -> None:
        for _ in range(n):
            value = f"{self.txn}-{len(self.values)}"
            self.values.append(value)
            self.producer.produce(self.topic, key=value.encode(), value=value.encode())

    def open(self, n: int, position: int | None = None) -> None:
        self.values = []
        self.position = position
        self.producer.begin_transaction()
        self.produce(n)
        if position is not None:
            from confluent_kafka import TopicPartition

            self.producer.send_offsets_to_transaction([TopicPartition(self.topic, 0, position)], self.group_metadata)
        self.producer.flush(30)

    def prepare(self, n: int, position: int | None = None) -> PreparedTxnState:
        self.open(n, position)
        return self.producer.prepare_transaction(30)

    def store(self, state: PreparedTxnState) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        self.db.executemany("INSERT INTO rows VALUES (?, ?)", [(self.txn, v) for v in self.values])
        if self.position is not None:
            self.db.execute("INSERT INTO positions VALUES (?, ?)", (self.txn, self.position))
        self.db.execute(
            "INSERT INTO kafka_txn_state VALUES (?, ?) ON CONFLICT(transactional_id) DO UPDATE SET state = excluded.state",
            (self.tid, str(state)),
        )
        self.db.execute("COMMIT")

    def step(self, step: str) -> None:
        kind, _, spec = step.partition(":")
        count, _, at = spec.partition("@")
        n = int(count or 0)
        position = int(at) if at else None
        if kind == "commit":
            state = self.prepare(n, position)
            self.store(state)
            self.producer.commit_transaction(30)
            self.txn += 1
            say(f"COMMITTED {state}")
        elif kind == "stored":
            state = self.prepare(n, position)
            self.store(state)
            say(f"STORED {state}")
        elif kind == "prepared":
            say(f"PREPARED {self.prepare(n, position)}")
        elif kind == "open":
            self.open(n, position)
            say("OPEN")
        else:
            raise SystemExit(f"unknown step {step!r}")

    def command(self, line: str) -> bool:
        kind, _, count = line.partition(":")
        try:
            if kind == "commit":
                self.producer.commit_transaction(30)
                say("OK committed")
            elif kind == "produce":
                self.produce(int(count))
                self.producer.flush(30)
                say(f"OK produced {count}")
            elif kind == "prepare":
                say(f"OK {self.producer.prepare_transaction(30)}")
            elif kind == "exit":
                return False
            else:
                say(f"ERROR ValueError unknown command {line!r}")
        except Exception as exc:  # noqa: BLE001 - the parent asserts on the class name
            say(f"ERROR {type(exc).__name__} {exc}".replace("\n", " "))
        return True


def main(argv: list[str]) -> int:
    bootstrap, topic, tid, db_path, *rest = argv
    timeout_ms = None
    group = None
    if rest[:1] == ["--timeout-ms"]:
        timeout_ms, rest = int(rest[1]), rest[2:]
    if rest[:1] == ["--group"]:
        group, rest = rest[1], rest[2:]
    try:
        writer = Writer(bootstrap, topic, tid, db_path, timeout_ms, group)
        for step in rest:
            writer.step(step)
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
        say("CRASHED " + traceback.format_exc().replace("\n", " | "))
        return 1
    say("READY")
    for line in sys.stdin:
        if not writer.command(line.strip()):
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
