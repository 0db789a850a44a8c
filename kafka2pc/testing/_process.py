"""The local broker's processes: whether a JVM is alive, signalling and reaping it, finding ``java``, its log's tail."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from kafka2pc.testing._common import BrokerError


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child is not alive
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        return state != "Z"
    except OSError:
        return True


def _reap(pid: int) -> None:
    if pid <= 0:
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_dead(pids: Sequence[int], timeout: float) -> bool:
    """Wait until every pid has exited (reaping our own children); False after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in pids:
            _reap(pid)
        if not any(_pid_alive(pid) for pid in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and Path(home, "bin", "java").exists():
        return str(Path(home, "bin", "java"))
    java = shutil.which("java")
    if java is None:
        raise BrokerError("Java 17+ is needed to run Kafka: apt-get install openjdk-17-jre-headless")
    return java


def log_tail(path: Path, lines: int = 5) -> str:
    """The last ``lines`` lines of ``path`` (a node's ``server.log``), for an error message; ``""`` when unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            tail = f.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "\n".join(tail)
