"""Helpers of the Spark sink tests: driver processes to SIGKILL, and the exactly-once checks.

Imported as ``_sparkkit`` (pytest puts tests/spark on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafka2pc.testing import drain, end_offsets

DRIVER = Path(__file__).with_name("_spark_driver.py")
REPO = Path(__file__).resolve().parents[2]
RUN_ENV = "K2PC_SPARK_TEST_RUN"


def write_json_files(directory: Path, rows_per_file: list[int], start: int = 0) -> list[bytes]:
    """JSON-lines input files ``f00000.json``, ... with rows ``{"id": i, "v": "m<i>"}``; return the values.

    Files are named in order and written whole (temp file + rename), so a
    streaming file source picks them up in order, ``files_per_batch`` at a time.
    """
    directory.mkdir(parents=True, exist_ok=True)
    values = []
    i = start
    for n, count in enumerate(rows_per_file):
        lines = []
        for _ in range(count):
            lines.append(json.dumps({"id": i, "v": f"m{i}"}))
            values.append(f"m{i}".encode())
            i += 1
        tmp = directory / f".f{n:05d}.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.rename(directory / f"f{n:05d}.json")
    return values


def processes_of_run(run_id: str) -> list[int]:
    """Pids of live processes whose environment carries ``RUN_ENV=run_id`` (driver, JVM, Python workers)."""
    needle = f"{RUN_ENV}={run_id}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except OSError:
            continue
        if needle in env.split(b"\0") and not zombie:
            pids.append(int(entry))
    return pids


@dataclass
class DriverRun:
    """One ``_spark_driver.py`` process (its own session and process group)."""

    proc: subprocess.Popen[bytes]
    run_id: str
    log_path: Path
    metrics_path: Path
    stderr_path: Path

    def log(self) -> str:
        parts = []
        for path in (self.log_path, self.stderr_path):
            try:
                parts.append(path.read_text()[-4000:])
            except OSError:
                pass
        return "\n---\n".join(parts)

    def kill_group(self) -> None:
        """SIGKILL the driver's process group (Python driver + Spark JVM), then every straggler of the run."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        deadline = time.monotonic() + 20
        while (left := processes_of_run(self.run_id)) and time.monotonic() < deadline:
            time.sleep(0.5)  # the PySpark daemon (own process group) exits when the JVM's pipe closes
        for pid in left:
            os.kill(pid, signal.SIGKILL)  # only our own run's processes, found by their marker
        assert not left, f"processes of the killed driver outlived it: {left}"


CONNECT_SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


def start_connect_server(work: Path, name: str, port: int, master: str = "local[3,4]") -> DriverRun:
    """A Spark Connect server in its own process group (PySpark's ``SparkConnectServer``, as
    ``sbin/start-connect-server.sh`` runs it), listening on ``127.0.0.1:port``; returns once it accepts connections.

    Its JVM, Python workers (PYSPARK_PYTHON: this interpreter, which has kafka2pc) and ``foreachBatch``
    worker carry the run's marker, so :meth:`DriverRun.kill_group` SIGKILLs all of them.
    """
    import pyspark

    run_id = uuid.uuid4().hex
    stderr_path = work / f"{name}.server.stderr"
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE")}
    env[RUN_ENV] = run_id
    env["PYSPARK_PYTHON"] = sys.executable
    # PySpark finds pyspark_* modules by listing sys.path (pkgutil), which does not see an editable install's
    # import hook. A wheel puts pyspark_kafka2pc.py in site-packages; here the checkout's copy is put on the
    # path. (A classic driver's workers start in its working directory, the checkout; a Connect server's start
    # in each session's artifact directory.)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    command = [
        str(submit), "--class", CONNECT_SERVER_CLASS, "--name", f"kafka2pc-{name}", "--master", master,
        "--conf", "spark.connect.grpc.binding.address=127.0.0.1", "--conf", f"spark.connect.grpc.binding.port={port}",
        "--conf", f"spark.pyspark.python={sys.executable}", "--conf", "spark.ui.enabled=false",
        "--conf", "spark.sql.shuffle.partitions=2", "--conf", "spark.sql.streaming.minBatchesToRetain=20",
    ]
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    server = DriverRun(proc, run_id, stderr_path, work / f"{name}.server.unused", stderr_path)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the Connect server exited (rc={proc.returncode}): {server.log()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server
        except OSError:
            time.sleep(0.5)
    server.kill_group()
    raise AssertionError(f"the Connect server did not listen on {port} in 180 s: {server.log()}")


@dataclass
class ConnectChain:
    """Driver runs of one query or job on Spark Connect: each run gets a new server (the last one was SIGKILLed)."""

    work: Path
    port: int
    master: str = "local[3,4]"
    lives: int = 0

    def server(self, name: str) -> DriverRun:
        self.lives += 1
        return start_connect_server(self.work, name, self.port, self.master)

    def crash(self, cfg: dict[str, Any], crash_at: str, crash_batch: int, name: str) -> str:
        """Run the client until the sink reaches ``crash_at`` of ``crash_batch`` in the server; SIGKILL the server."""
        server = self.server(name)
        try:
            return crash_driver(dict(cfg, remote=f"sc://127.0.0.1:{self.port}"), self.work, crash_at, crash_batch,
                                name, also_kill=server)
        finally:
            server.kill_group()

    def finish(self, cfg: dict[str, Any], name: str) -> list[dict[str, Any]]:
        """Run the client to the end on a new server; stop the server."""
        server = self.server(name)
        try:
            return finish_driver(dict(cfg, remote=f"sc://127.0.0.1:{self.port}"), self.work, name)
        finally:
            server.kill_group()


def start_driver(
    cfg: dict[str, Any], work: Path, faults: dict[str, Any] | None, name: str
) -> DriverRun:
    run_id = uuid.uuid4().hex
    log_path = work / f"{name}.log"
    metrics_path = work / f"{name}.metrics.json"
    stderr_path = work / f"{name}.stderr"
    full = dict(cfg, log_path=str(log_path), metrics_path=str(metrics_path))
    full.setdefault("error_path", str(work / f"{name}.error"))
    env = dict(os.environ)
    env[RUN_ENV] = run_id
    env["PYSPARK_PYTHON"] = sys.executable
    env.pop("K2PC_SPARK_TEST_CRASH", None)
    if faults is not None:
        env["K2PC_SPARK_TEST_CRASH"] = json.dumps(faults)
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, str(DRIVER), json.dumps(full)],
            env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        )
    return DriverRun(proc, run_id, log_path, metrics_path, stderr_path)


def crash_driver(
    cfg: dict[str, Any], work: Path, crash_at: str, crash_batch: int, name: str, also_kill: DriverRun | None = None
) -> str:
    """Run the driver until the sink reaches ``crash_at`` in ``crash_batch``; SIGKILL its group there.

    ``also_kill``: the Spark Connect server the driver is a client of, SIGKILLed first (it is where the
    sink runs).
    """
    marker = work / f"{name}.crashed"
    run = start_driver(
        cfg, work, {"crash_at": crash_at, "crash_batch": crash_batch, "crash_marker": str(marker)}, name
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            if run.proc.poll() is not None:
                raise AssertionError(f"driver exited (rc={run.proc.returncode}) before {crash_at}: {run.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"driver never reached {crash_at} of batch {crash_batch}: {run.log()}")
            time.sleep(0.2)
    finally:
        if also_kill is not None:
            also_kill.kill_group()
        run.kill_group()
    return marker.read_text().strip()


def fail_driver(cfg: dict[str, Any], work: Path, name: str) -> str:
    """Run the driver (no faults) expecting its query to fail; return the query's error."""
    error_path = work / f"{name}.error"
    run = start_driver(dict(cfg, error_path=str(error_path)), work, None, name)
    try:
        rc = run.proc.wait(300)
    finally:
        if run.proc.poll() is None or processes_of_run(run.run_id):
            run.kill_group()
    assert rc == 3, f"driver did not fail as expected (rc={rc}): {run.log()}"
    return error_path.read_text()


def finish_driver(cfg: dict[str, Any], work: Path, name: str) -> list[dict[str, Any]]:
    """Run the driver to the end (no faults); return the sink's metrics."""
    run = start_driver(cfg, work, None, name)
    try:
        rc = run.proc.wait(300)
    finally:
        if run.proc.poll() is None or processes_of_run(run.run_id):
            run.kill_group()
    assert rc == 0, f"driver failed (rc={rc}): {run.log()}"
    metrics: list[dict[str, Any]] = json.loads(run.metrics_path.read_text())
    return metrics


def assert_exactly_once(bootstrap: str, topic: str, expected: list[bytes]) -> None:
    """A read_committed reader sees every expected value exactly once, and nothing else; nothing is hanging."""
    committed = drain(bootstrap, topic, "read_committed")
    seen = Counter(r.value for r in committed)
    duplicates = {v: n for v, n in seen.items() if n > 1}
    missing = set(expected) - set(seen)
    unexpected = set(seen) - set(expected)
    assert not duplicates, f"{len(duplicates)} values duplicated, e.g. {list(duplicates.items())[:5]}"
    assert not missing, f"{len(missing)} values lost, e.g. {sorted(missing)[:5]}"
    assert not unexpected, f"{len(unexpected)} unexpected values, e.g. {sorted(unexpected)[:5]}"
    assert len(committed) == len(expected)
    assert end_offsets(bootstrap, topic, "read_committed") == end_offsets(bootstrap, topic, "read_uncommitted"), (
        "a transaction is left hanging: the last stable offset is behind the high watermark"
    )


def hanging(bootstrap: str, topic: str) -> int:
    """Records held back from read_committed readers by open transactions."""
    lso = end_offsets(bootstrap, topic, "read_committed")
    hw = end_offsets(bootstrap, topic, "read_uncommitted")
    return sum(hw[p] - lso[p] for p in hw)


def decision_outcomes(bootstrap: str, checkpoint: Path, batch_id: int) -> list[str]:
    """Per transaction the stored decision of ``batch_id`` names: ``"committed"`` or ``"prepared"``.

    Asked from the coordinator (a reader cannot tell yet: an open transaction
    holds the last stable offset back).  ``"prepared"`` means the open
    transaction under that id is exactly the recorded one (the recovery plan
    would commit it).
    """
    from kafka2pc.recipes.spark import LocalDecisionStore

    from kafka2pc import Decision, TransactionAdmin

    (sink_dir,) = (checkpoint / "kafka2pc").iterdir()
    decision = LocalDecisionStore(sink_dir).get(batch_id)
    assert decision is not None, f"no decision for batch {batch_id} in {sink_dir}"
    found = []
    with TransactionAdmin({"bootstrap.servers": bootstrap}) as admin:
        for txn in decision.transactions:
            plan = admin.plan_recovery(txn.transactional_id, txn.prepared_state)
            assert plan.coordinator is not None
            if plan.decision is Decision.COMMIT:
                found.append("prepared")
            elif plan.coordinator.state == "CompleteCommit":
                found.append("committed")
            else:
                found.append(f"{plan.decision.value}/{plan.coordinator.state}")
    return found
