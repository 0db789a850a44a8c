"""Two processes fetching Kafka's jars at once: one Maven at a time, the second reuses the first's download."""

from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path
from typing import TextIO

import pytest

from kafka2pc.testing import _fetch
from kafka2pc.testing.broker import BrokerError


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KAFKA2PC_CACHE", str(tmp_path))
    (tmp_path / "maven").mkdir()
    return tmp_path


def _hold_lock(cache: Path) -> TextIO:
    lock = open(cache / "maven" / ".fetch.lock", "w")  # noqa: SIM115 - held across the test
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def test_a_fetch_waits_for_the_running_one_and_reuses_its_download(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []
    monkeypatch.setattr(_fetch, "_maven_fetch_locked", lambda libs, deps, what: ran.append("mvn") or libs)
    libs = cache / "maven" / "9.9.9" / "libs"
    lock = _hold_lock(cache)

    def first_fetch_finishes() -> None:
        time.sleep(1.0)
        libs.mkdir(parents=True)
        (libs / ".complete").write_text("1s\n")
        lock.close()

    threading.Thread(target=first_fetch_finishes).start()
    started = time.monotonic()
    assert _fetch._maven_fetch(libs, [("org.apache.kafka", "kafka_2.13", "9.9.9")], "Kafka 9.9.9") == libs
    assert time.monotonic() - started >= 0.9  # it waited for the other fetch ...
    assert ran == []  # ... and did not run Maven again


def test_a_fetch_that_cannot_get_the_lock_fails_within_its_bound(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fetch, "FETCH_LOCK_TIMEOUT_S", 1.0)
    monkeypatch.setattr(_fetch, "_maven_fetch_locked", lambda *a: pytest.fail("fetched without the lock"))
    lock = _hold_lock(cache)
    started = time.monotonic()
    with pytest.raises(BrokerError, match="another process's Maven fetch"):
        _fetch._maven_fetch(cache / "maven" / "9.9.9" / "libs", [], "Kafka 9.9.9")
    assert time.monotonic() - started < 5
    lock.close()
