"""A Spark standalone cluster on loopback for the tests: one Master, two Workers on two "hosts".

Started from the pyspark installation (``$SPARK_HOME`` = the ``pyspark``
package directory, ``bin/spark-class``): the Master on 127.0.0.1, one Worker
bound to 127.0.0.1 and one to 127.0.0.2.  Spark tells hosts apart by address,
so the two Workers count as two hosts: a speculative copy of a task may run
on the other Worker (Spark never runs two attempts of a task on one host).

Ports: the Master and Workers listen in the first free slot of 20 ports in
``[base + 1700, base + 1800)`` of the ``$KAFKA2PC_PORT_BASE`` block (below the
kernel's ephemeral range), so they never collide with the local brokers, with
another checkout's cluster, or with a second test session of this checkout.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kafka2pc.testing.broker import port_base

RUN_ENV = "K2PC_SPARK_CLUSTER_RUN"
_RUNNING_TASK = re.compile(r"Running task (\d+)\.(\d+) in stage (\d+\.\d+)")
WORKER_HOSTS = ("127.0.0.1", "127.0.0.2")


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name} exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"nothing listens on {host}:{port} after {timeout:.0f}s: {log.read_text()[-3000:]}")


@dataclass
class StandaloneCluster:
    """A running Master + Workers; :meth:`stop` kills them and every executor they launched."""

    work: Path
    master_port: int
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.master_port}"

    def _spawn(self, name: str, args: list[str], host: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env.update({
            "SPARK_HOME": str(spark_home()), "SPARK_LOCAL_IP": host, "SPARK_LOCAL_HOSTNAME": host,
            "SPARK_DAEMON_MEMORY": "256m", "SPARK_LOG_DIR": str(self.work), "SPARK_WORKER_DIR": str(self.work / name),
            RUN_ENV: self.run_id,
        })
        log = self.work / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [str(spark_home() / "bin" / "spark-class"), *args],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def start(self) -> StandaloneCluster:
        base = self.master_port
        master = self._spawn("master", [
            "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(base),
            "--webui-port", str(base + 1),
        ], "127.0.0.1")
        _wait_port("127.0.0.1", base, 120, master, self.work / "master.log")
        for i, host in enumerate(WORKER_HOSTS):
            port = base + 10 + 2 * i
            worker = self._spawn(f"worker{i}", [
                "org.apache.spark.deploy.worker.Worker", "--host", host, "--port", str(port),
                "--webui-port", str(port + 1), "--cores", "2", "--memory", "1g", self.master_url,
            ], host)
            _wait_port(host, port, 120, worker, self.work / f"worker{i}.log")
        self._wait_registered(len(WORKER_HOSTS))
        return self

    def _wait_registered(self, workers: int, timeout: float = 120) -> None:
        log = self.work / "master.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if log.read_text().count("Registering worker") >= workers:
                return
            time.sleep(0.3)
        raise RuntimeError(f"the workers did not register with the master: {log.read_text()[-3000:]}")

    def applications(self) -> set[str]:
        """Ids of the applications that have run executors on the Workers so far."""
        return {app.name for i in range(len(WORKER_HOSTS)) for app in (self.work / f"worker{i}").glob("app-*")}

    def task_attempts(self, apps: set[str]) -> list[tuple[str, str, int, int, str]]:
        """``(app, stage, task, attempt, host)`` of every task attempt the executors of ``apps`` ran.

        Read from the executors' logs (``Running task 0.1 in stage 1.0``), so
        it shows where Spark really ran each attempt.
        """
        found = []
        for i, host in enumerate(WORKER_HOSTS):
            for app in apps:
                for log in (self.work / f"worker{i}" / app).glob("*/stderr"):
                    for match in _RUNNING_TASK.finditer(log.read_text(errors="replace")):
                        task, attempt, stage = match.groups()
                        found.append((app, stage, int(task), int(attempt), host))
        return found

    def executor_pids(self) -> list[int]:
        """Pids of the executor JVMs the Workers launched (they inherit the run marker)."""
        needle = f"{RUN_ENV}={self.run_id}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if needle in env and b"CoarseGrainedExecutorBackend" in cmd:
                pids.append(int(entry))
        return pids

    def stop(self) -> None:
        for pid in self.executor_pids():
            try:
                os.kill(pid, signal.SIGKILL)  # our own run's executors, found by their marker
            except ProcessLookupError:
                pass
        for proc in reversed(self.procs):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)


def _free(port: int) -> bool:
    for host in WORKER_HOSTS:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def start_cluster(work: Path) -> StandaloneCluster:
    """Start a cluster on the first free slot of 20 ports in ``[base + 1700, base + 1800)``."""
    work.mkdir(parents=True, exist_ok=True)
    for first in range(port_base() + 1700, port_base() + 1800, 20):
        if all(_free(first + offset) for offset in (0, 1, 10, 11, 12, 13)):
            return StandaloneCluster(work, first).start()
    raise RuntimeError(f"no free ports for a Spark cluster in [{port_base() + 1700}, {port_base() + 1800})")


def java_ancestor(pid: int) -> int | None:
    """The nearest ancestor of ``pid`` that is a JVM (a Python worker's executor)."""
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            return None
        if b"CoarseGrainedExecutorBackend" in cmd:
            return pid
        pid = int(stat.rsplit(b")", 1)[1].split()[1])
    return None
