"""Run ``_log_child.py`` through a normal start and a broker outage; count what it logged.

Imported by the tests as ``_outage``; also a script, to measure another
checkout: ``PYTHONPATH=tests python tests/logs/_outage.py [--pythonpath DIR] [--outage-s 60]``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kafka2pc.testing import create_topic
from kafka2pc.testing.broker import BrokerError, LocalKafka

CHILD = Path(__file__).with_name("_log_child.py")


@dataclass
class PhaseCounts:
    """What a user would see on stderr in one phase, and what the child's counting handler saw."""

    raw_librdkafka: int = 0
    """Lines librdkafka wrote to stderr itself (``%3|...|FAIL|...``)."""
    log_lines: int = 0
    """WARNING-and-up lines of Python logging on stderr (``logging.basicConfig()``'s default)."""
    other: int = 0
    lines: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Every stderr line of the phase."""
        return self.raw_librdkafka + self.log_lines + self.other


@dataclass
class OutageRun:
    """Per phase (``start``, ``outage``) stderr counts, and the child's INFO-and-up record counts."""

    phases: dict[str, PhaseCounts]
    records: Counter[str]
    committed_before: int
    committed_after: int


def _pump(stream: object, sink: queue.Queue[str | None]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        sink.put(line.rstrip("\n"))
    sink.put(None)


def run_outage(kafka: LocalKafka, *, outage_s: float = 60.0, pythonpath: str | None = None) -> OutageRun:
    """Start the child, let it commit, stop ``kafka`` for ``outage_s``, restart it, wait for new commits."""
    topic = create_topic(kafka.bootstrap_servers)
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), kafka.bootstrap_servers, topic, f"k2pc-logs-{uuid.uuid4().hex[:8]}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    out: queue.Queue[str | None] = queue.Queue()
    err: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, out), daemon=True).start()
    threading.Thread(target=_pump, args=(proc.stderr, err), daemon=True).start()

    def committed_at_least(n: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = out.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"child exited early (rc={proc.wait(5)}): {_drain(err)}")
            if line.startswith("COMMITTED ") and int(line.split()[1]) >= n:
                return int(line.split()[1])
        raise AssertionError(f"child did not reach {n} commits in {timeout}s: {_drain(err)[-20:]}")

    def marked(lines: queue.Queue[str | None], mark: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(f"child exited before {mark!r} (rc={proc.wait(5)}): {_drain(err)}")
            if line.startswith(mark):
                return
        raise AssertionError(f"child did not print {mark!r} in {timeout}s")

    try:
        before = committed_at_least(3, 120)
        proc.stdin.write("outage\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        marked(out, "MARK outage", 30)  # the child counts its lines as the outage's from here on
        kafka.stop()
        time.sleep(outage_s)
        _restart(kafka)
        after = committed_at_least(before + 3, 180)
        proc.stdin.write("stop\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        records: Counter[str] = Counter()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = out.get(timeout=60)
            if line is None:
                break
            if line.startswith("COUNTS "):
                records = Counter(json.loads(line[len("COUNTS "):]))
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if not kafka.running():
            _restart(kafka)
    phases = {"start": PhaseCounts(), "outage": PhaseCounts()}
    phase = phases["start"]
    for line in _drain(err):
        if line.startswith("MARK outage"):
            phase = phases["outage"]
            continue
        phase.lines.append(line)
        if line.startswith("%"):
            phase.raw_librdkafka += 1
        elif line.startswith("LOG "):
            phase.log_lines += 1
        else:
            phase.other += 1
    return OutageRun(phases, records, before, after)


def _restart(kafka: LocalKafka) -> None:
    """Start ``kafka`` again once its old process has released the ports (a dying JVM may hold them)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            kafka.start()
            return
        except BrokerError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def _drain(q: queue.Queue[str | None]) -> list[str]:
    lines = []
    while True:
        try:
            line = q.get(timeout=2)
        except queue.Empty:
            return lines
        if line is None:
            return lines
        lines.append(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pythonpath", help="import kafka2pc from this checkout")
    parser.add_argument("--outage-s", type=float, default=60.0)
    args = parser.parse_args()
    from harness.ports import private_broker

    with private_broker("logs/outage") as kafka:
        run = run_outage(kafka, outage_s=args.outage_s, pythonpath=args.pythonpath)
    for name, counts in run.phases.items():
        print(f"{name}: {counts.total} stderr lines ({counts.raw_librdkafka} raw librdkafka, "
              f"{counts.log_lines} logging WARNING+, {counts.other} other)")
        for line in counts.lines[:15]:
            print("   ", line[:200])
    print("records INFO+:", dict(run.records))
    print("committed before/after:", run.committed_before, run.committed_after)


if __name__ == "__main__":
    main()
