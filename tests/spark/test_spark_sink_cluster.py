"""Both paths on a Spark standalone cluster (Master + two Workers on 127.0.0.1 and 127.0.0.2).

One driver process (``_spark_driver.py``) runs a job on the cluster with
two faults: a real speculative copy of a slow task on the other Worker
("host") in one batch, and an executor JVM killed with SIGKILL while its task
holds a prepared transaction in the next; and, for ``format("kafka2pc")``, a
batch job whose executor is killed the same way.  Every row must be visible
exactly once, nothing left open.  It runs for the ``foreachBatch`` sink (a rate
source) and, on PySpark 4, for
``format("kafka2pc")`` (JSON files, AvailableNow: the data source has no
per-batch hook to stop at a batch).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyspark
import pytest
from _sparkkit import assert_exactly_once, start_driver, write_json_files
from _standalone import StandaloneCluster, java_ancestor, start_cluster
from kafka2pc.recipes.spark import LocalDecisionStore

PATHS = ["foreachBatch"] + (["datasource"] if int(pyspark.__version__.split(".")[0]) >= 4 else [])
"""The write paths this PySpark line has (the data source needs PySpark 4)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """A standalone cluster for this module's tests (started once, killed at the end)."""
    running = start_cluster(tmp_path_factory.mktemp("spark-cluster"))
    try:
        yield running
    finally:
        running.stop()


def cluster_conf(cluster: StandaloneCluster, **extra: str) -> dict[str, Any]:
    conf = {
        "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
        "spark.executor.memory": "512m", "spark.executor.cores": "2", "spark.cores.max": "4",
        "spark.task.maxFailures": "4", "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
    }
    conf.update(extra)
    return conf


def nums(n: int) -> list[bytes]:
    return [str(i).encode() for i in range(n)]


def source_cfg(path: str, tmp_path: Path, rows: int, last: int) -> tuple[dict[str, Any], list[bytes]]:
    """The driver's input for ``path`` (batches 0..last of ``rows`` rows) and the values it must write."""
    if path == "foreachBatch":
        return {"source": "rate", "rows_per_batch": rows, "last_batch": last}, nums(rows * (last + 1))
    expected = write_json_files(tmp_path / "in", [rows // 2] * (2 * (last + 1)))
    return {"sink": "datasource", "source": "files", "files_dir": str(tmp_path / "in"), "files_per_batch": 2}, expected


def attempt_used(path: str, tmp_path: Path, metrics_path: Path, batch: int, partition: int) -> int:
    """The attempt number whose result the batch's decision took for ``partition``."""
    if path == "foreachBatch":
        metrics = {m["batch_id"]: m for m in json.loads(metrics_path.read_text())}
        return int(metrics[batch]["task_attempts"][str(partition)])
    (sink_dir,) = (tmp_path / "chk" / "kafka2pc").iterdir()
    decision = LocalDecisionStore(sink_dir).get(batch)
    assert decision is not None
    (tid,) = [t.transactional_id for t in decision.transactions if t.partition == partition]
    return int(tid.rsplit(".", 1)[1])


def run_killing_the_executor(
    cluster: StandaloneCluster, cfg: dict[str, Any], tmp_path: Path, marker: Path
) -> tuple[Any, int]:
    """Run the driver; when a task hook (``BlockAt``) writes ``marker``, SIGKILL the executor JVM of the
    Python worker it names; the driver must then finish (exit 0).  The finished run, and the attempt
    number of the task attempt that was killed."""
    run = start_driver(cfg, tmp_path, None, "run")
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert run.proc.poll() is None, f"driver exited early: {run.log()}"
            assert time.monotonic() < deadline, f"the task never reached the kill point: {run.log()}"
            time.sleep(0.05)
        pid, killed_attempt = (int(field) for field in marker.read_text().split())
        executor = java_ancestor(pid)
        assert executor is not None and executor in cluster.executor_pids()
        os.kill(executor, signal.SIGKILL)
        rc = run.proc.wait(300)
    finally:
        if run.proc.poll() is None:
            run.kill_group()
    assert rc == 0, f"driver failed (rc={rc}): {run.log()}"
    return run, killed_attempt


@pytest.mark.parametrize("path", PATHS)
def test_speculative_copy_then_executor_killed_while_its_task_holds_a_prepared_transaction(
    cluster: StandaloneCluster, kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path, path: str
) -> None:
    """One job, two faults.  Batch 1: attempt 0 of one task stalls after opening its transaction, and
    Spark runs a speculative copy on the other Worker ("host"), which wins.  Batch 2: the executor
    whose task holds a prepared transaction is killed with SIGKILL, and the task runs again."""
    rows, last = 300, 3
    out = topic_factory(partitions=2)
    marker = tmp_path / "blocked.pid"
    source, expected = source_cfg(path, tmp_path, rows, last)
    cfg = {
        "bootstrap": kafka_bootstrap, "out_topic": out, "checkpoint": str(tmp_path / "chk"), **source,
        "master": cluster.master_url,
        "spark_conf": cluster_conf(
            cluster, **{
                "spark.speculation": "true", "spark.speculation.interval": "200ms",
                "spark.speculation.multiplier": "1.5", "spark.speculation.quantile": "0.5",
                # The stalled task is speculated after 5 s; the blocked one is killed well before that.
                "spark.speculation.minTaskRuntime": "5s",
            }
        ),
        "task_hook": [
            {"kind": "SlowAt", "batch": 1, "partition": 0, "seconds": 25},
            {"kind": "BlockAt", "step": "prepared", "batch": 2, "partition": 0, "marker": str(marker)},
        ],
    }
    before = cluster.applications()
    run, killed = run_killing_the_executor(cluster, cfg, tmp_path, marker)
    if path == "foreachBatch":
        metrics = {m["batch_id"]: m for m in json.loads(run.metrics_path.read_text())}
        assert sorted(metrics) == list(range(last + 1))
    # Batch 1: nothing failed, so an attempt number above 0 is the speculative copy, and it won; the
    # executors' logs show both attempts of one task, running at once on the two hosts.
    assert attempt_used(path, tmp_path, run.metrics_path, 1, 0) >= 1
    attempts = cluster.task_attempts(cluster.applications() - before)
    hosts: dict[tuple[str, str, int], dict[int, str]] = {}
    for app, stage, task, attempt, host in attempts:
        hosts.setdefault((app, stage, task), {})[attempt] = host
    speculated = [key for key, by_attempt in hosts.items() if {0, 1} <= set(by_attempt)
                  and by_attempt[0] != by_attempt[1]]
    assert speculated, f"no task ran two attempts on two hosts: {sorted(attempts)}"
    # Batch 2: the killed attempt's task ran again, and its decision took another attempt.
    assert attempt_used(path, tmp_path, run.metrics_path, 2, 0) != killed
    assert_exactly_once(kafka_bootstrap, out, expected)


if "datasource" in PATHS:

    @pytest.mark.campaign  # about 65 s; in CI the streaming job's executor is killed the same way
    def test_batch_job_with_an_executor_killed_while_its_task_holds_a_prepared_transaction(
        cluster: StandaloneCluster, kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path
    ) -> None:
        """``df.write.format("kafka2pc")``: the executor running attempt 0 of partition 0 is killed with
        SIGKILL once that attempt prepared its transaction; the task runs again under its next attempt's
        id, the job commits, and the killed attempt's transaction is aborted, not left hanging."""
        out = topic_factory(partitions=2)
        marker = tmp_path / "blocked.pid"
        expected = write_json_files(tmp_path / "in", [150] * 4)
        cfg = {
            "bootstrap": kafka_bootstrap, "out_topic": out, "sink": "datasource", "source": "batch",
            "files_dir": str(tmp_path / "in"), "run_id": "cluster-batch", "decision_path": str(tmp_path / "d"),
            "master": cluster.master_url, "spark_conf": cluster_conf(cluster),
            "task_hook": {"kind": "BlockAt", "step": "prepared", "batch": 0, "partition": 0, "marker": str(marker)},
        }
        _, killed = run_killing_the_executor(cluster, cfg, tmp_path, marker)
        (sink_dir,) = (tmp_path / "d").iterdir()
        decision = LocalDecisionStore(sink_dir).get(0)
        assert decision is not None
        (tid,) = [t.transactional_id for t in decision.transactions if t.partition == 0]
        assert int(tid.rsplit(".", 1)[1]) != killed  # the killed attempt's task ran again, and that attempt counted
        assert_exactly_once(kafka_bootstrap, out, expected)
