"""Faults a test inflicts on a private broker (:func:`harness.ports.private_broker`)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kafka2pc.testing.broker import LocalKafka


@contextmanager
def frozen(kafka: LocalKafka) -> Iterator[None]:
    """SIGSTOP the broker's JVM for the duration of the block (every thread stopped on entry), then SIGCONT it."""
    pid = kafka.nodes[0].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until_stopped(pid)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_until_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until every thread of ``pid`` is stopped: ``kill`` returns before a busy JVM's threads halt."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                continue  # the thread ended meanwhile
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    pytest.fail(f"broker process {pid} did not stop within {timeout_s} s of SIGSTOP")
