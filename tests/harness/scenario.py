"""Crash-test helpers of the core and asyncio tests: a dual-writing child the test can kill -9, the end-state checks.

A :class:`Scenario` is one transactional id, one topic and one SQLite
database; its children run a script (``core/_child.py`` with the sync
producer, ``aio/_aio_child.py`` with the asyncio one) that reads the steps
it is given and prints a marker after each.  Each directory's
``conftest.py`` gives its tests a ``scenario_factory`` fixture from
:func:`scenario_factory_fixture`.
"""

from __future__ import annotations

import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harness.acks import ACK_LOG_ENV, AckLog, assert_acknowledged
from harness.procs import REPO, child_env
from kafka2pc import PreparedTxnState
from kafka2pc.testing import create_topic, drain, end_offsets


@dataclass
class Child:
    """A running child script: read its markers, send it commands, kill it."""

    proc: subprocess.Popen[str]
    bootstrap: str
    topic: str
    transactional_id: str
    db_path: Path
    log_path: Path
    _lines: queue.Queue[str | None] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def expect(self, marker: str, timeout: float = 60.0) -> str:
        """Wait for the next line; it must start with ``marker``; return the rest."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"child printed nothing within {timeout}s (expected {marker}); log: {self.log()}")
        if line is None:
            raise AssertionError(f"child exited (rc={self.proc.wait(5)}) before {marker}; log: {self.log()}")
        assert line.startswith(marker), f"expected {marker}, got {line!r}; log: {self.log()}"
        return line[len(marker):].strip()

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def signal(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)

    def kill(self) -> None:
        """``kill -9`` and reap."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        assert self.proc.returncode in (-signal.SIGKILL, 0, 1)

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-3000:]
        except OSError:
            return "<no log>"


@dataclass
class Scenario:
    """One transactional id, one topic, one SQLite database: what the application owns."""

    bootstrap: str
    topic: str
    transactional_id: str
    db_path: Path
    script: Path
    """The child script :meth:`spawn` runs (``core/_child.py`` or ``aio/_aio_child.py``)."""
    children: list[Child] = field(default_factory=list)

    @property
    def config(self) -> dict[str, str]:
        return {"bootstrap.servers": self.bootstrap, "transactional.id": self.transactional_id}

    @property
    def acks(self) -> AckLog:
        """The acknowledged-write log the children append to (``$KAFKA2PC_ACK_LOG``; ``harness.acks``)."""
        return AckLog(self.db_path.with_suffix(".acks"))

    @property
    def group(self) -> str:
        """The consumer group whose offsets the child commits with ``N@P`` steps."""
        return f"{self.transactional_id}-group"

    def spawn(self, *steps: str, timeout_ms: int | None = None) -> Child:
        """Start :attr:`script` running ``steps`` (see its docstring)."""
        args = [self.bootstrap, self.topic, self.transactional_id, str(self.db_path)]
        if timeout_ms is not None:
            args += ["--timeout-ms", str(timeout_ms)]
        if any("@" in step for step in steps):
            args += ["--group", self.group]
        log_path = self.db_path.with_name(f"child-{len(self.children)}.log")
        env = child_env(PYTHONUNBUFFERED="1", **{ACK_LOG_ENV: str(self.acks.path)})
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, str(self.script), *args, *steps],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=REPO,
            )
        child = Child(proc, self.bootstrap, self.topic, self.transactional_id, self.db_path, log_path)
        self.children.append(child)
        return child

    def stored_state(self) -> PreparedTxnState:
        """What the recovery routine reads from the database (empty when nothing was stored)."""
        if not self.db_path.exists():
            return PreparedTxnState()
        with sqlite3.connect(self.db_path) as db:
            try:
                row = db.execute(
                    "SELECT state FROM kafka_txn_state WHERE transactional_id = ?", (self.transactional_id,)
                ).fetchone()
            except sqlite3.OperationalError:  # killed before the schema existed
                return PreparedTxnState()
        return PreparedTxnState(row[0]) if row else PreparedTxnState()

    def db_position(self) -> int | None:
        """The consumed position of the last committed database transaction that stored one."""
        with sqlite3.connect(self.db_path) as db:
            row = db.execute("SELECT position FROM positions ORDER BY txn DESC LIMIT 1").fetchone()
        return None if row is None else int(row[0])

    def committed_position(self) -> int | None:
        """The group's committed offset for partition 0 of the topic (``None``: nothing committed)."""
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group,
                             "enable.auto.commit": False, "isolation.level": "read_committed"})
        try:
            (tp,) = consumer.committed([TopicPartition(self.topic, 0)], timeout=30)
        finally:
            consumer.close()
        return None if tp.offset < 0 else int(tp.offset)

    def db_values(self) -> list[str]:
        """The values of the database's committed rows (none before the schema existed)."""
        if not self.db_path.exists():
            return []
        with sqlite3.connect(self.db_path) as db:
            try:
                return sorted(v for (v,) in db.execute("SELECT value FROM rows"))
            except sqlite3.OperationalError:
                return []

    def visible(self) -> list[str]:
        """Values a read_committed consumer sees (with duplicates, if any)."""
        return sorted(r.value.decode() for r in drain(self.bootstrap, self.topic, "read_committed") if r.value)

    def assert_consistent(self, expected: list[str] | None = None) -> list[str]:
        """The dual-write invariant, checked on the real end state.

        Every committed database row has exactly one visible Kafka record and
        vice versa, every value the children acknowledged (:attr:`acks`) is
        among them, and no transaction is left hanging (last stable offset ==
        high watermark on every partition).
        """
        visible = self.visible()
        duplicates = [v for v, n in Counter(visible).items() if n > 1]
        assert duplicates == [], f"duplicates visible to read_committed: {duplicates}"
        rows = self.db_values()
        assert_acknowledged(self.acks, rows, visible)
        assert visible == rows, "database rows and visible Kafka records differ"
        if expected is not None:
            assert visible == sorted(expected)
        assert end_offsets(self.bootstrap, self.topic, "read_committed") == end_offsets(
            self.bootstrap, self.topic, "read_uncommitted"
        ), "a transaction is still open on the topic"
        return visible

    def assert_hanging(self) -> None:
        """A transaction is open: its records hold the last stable offset back."""
        lso = end_offsets(self.bootstrap, self.topic, "read_committed")
        hw = end_offsets(self.bootstrap, self.topic, "read_uncommitted")
        assert any(lso[p] < hw[p] for p in hw), (lso, hw)

    def close(self) -> None:
        for child in self.children:
            if child.proc.poll() is None:
                try:
                    os.kill(child.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            child.kill()


def scenario_factory_fixture(script: Path, prefix: str) -> Any:
    """A ``scenario_factory`` fixture whose scenarios run ``script``, with transactional ids ``<prefix>-<hex>``.

    ``scenario_factory(bootstrap, partitions=1)`` -> a fresh :class:`Scenario`;
    its children are killed at the end of the test.
    """

    @pytest.fixture(name="scenario_factory")
    def factory(tmp_path: Path) -> Iterator[Callable[..., Scenario]]:
        made: list[Scenario] = []

        def make(bootstrap: str, partitions: int = 1) -> Scenario:
            topic = create_topic(bootstrap, partitions=partitions)
            tid = f"{prefix}-{uuid.uuid4().hex[:10]}"
            scenario = Scenario(bootstrap, topic, tid, tmp_path / f"app-{len(made)}.db", script)
            made.append(scenario)
            return scenario

        yield make
        for scenario in made:
            scenario.close()

    return factory
