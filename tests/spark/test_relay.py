"""The relay of format("kafka2pc")'s driver-side calls, without Spark: a worker process sends, the driver logs.

The worker side runs in a child process, as PySpark's Python workers do; the driver side is
this process's relay thread.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time

import pytest
from kafka2pc.recipes.spark import BatchMetrics
from kafka2pc.recipes.spark._relay import monitor

WORKER = textwrap.dedent("""
    import logging, sys, time
    from kafka2pc.recipes.spark import BatchMetrics
    from kafka2pc.recipes.spark._relay import relayed

    address = sys.argv[1] if sys.argv[1] != "-" else None
    log = logging.getLogger("kafka2pc.recipes.spark_sink")
    with relayed(address) as relay:
        print("relay" if relay is not None else "no relay", flush=True)
        log.info("an info record")
        log.warning("run %s was committed already", "r1")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("a failure")
        if relay is not None:
            relay.send_batch(BatchMetrics(7, False, 30, 3, 3, 3, 0, 0, (), {0: 1, 1: 0}, 0.0, 0.1, 0.01, 0.02,
                                          0.03, 0.004, 0.005, 0.2, 0.01, sink_id="rabc"))
""")


def run_worker(address: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WORKER, address or "-"], capture_output=True, text=True, timeout=60)


def test_records_reach_the_driver_logging_at_its_level_and_batches_its_monitor(
    caplog: pytest.LogCaptureFixture,
) -> None:
    driver_monitor, address = monitor()
    assert monitor() == (driver_monitor, address)  # one per process
    seen: list[BatchMetrics] = []
    driver_monitor.add_batch_listener(seen.append)
    try:
        with caplog.at_level(logging.WARNING, logger="kafka2pc"):
            started = time.monotonic()
            worker = run_worker(address)
            elapsed = time.monotonic() - started
    finally:
        driver_monitor._listeners.remove(seen.append)
    assert worker.returncode == 0 and worker.stdout.strip() == "relay", worker.stderr
    relayed = [r for r in caplog.records if r.name == "kafka2pc.recipes.spark_sink"]
    assert [(r.levelname, r.getMessage()) for r in relayed] == [
        ("WARNING", "run r1 was committed already"), ("ERROR", "a failure"),
    ]  # the INFO record is below the driver's level: not sent
    assert "ValueError: boom" in (relayed[1].exc_text or "")
    assert "was committed already" not in worker.stderr  # relayed, not also printed by the worker
    (batch,) = seen
    assert batch == driver_monitor.last_batch_metrics and batch.sink_id == driver_monitor.sink_id == "rabc"
    assert batch.task_attempts == {0: 1, 1: 0} and batch.records == 30
    assert elapsed < 30


def test_without_a_relay_records_go_to_stderr_as_before(tmp_path: object) -> None:
    for address in (None, "/nonexistent/kafka2pc-relay.sock"):
        worker = run_worker(address)
        assert worker.returncode == 0 and worker.stdout.strip() == "no relay", worker.stderr
        assert "run r1 was committed already" in worker.stderr
