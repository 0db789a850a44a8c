"""Spark Connect: SIGKILL the Connect server (where the driver, the sink and its decisions' writer run), start a new one.

PySpark's own Connect server (``SparkConnectServer``, as ``sbin/start-connect-server.sh`` runs it) in a process
group of its own, and a client process (``_spark_driver.py`` with ``remote``) that writes through it.  At a
step of the protocol the server's Python (the data source's commit worker, the ``foreachBatch`` worker) marks
the step and blocks; the test SIGKILLs the server's process group (JVM and Python workers) and the client,
starts a new server, and runs the client again: the query restarts from its checkpoint, the batch job reruns
with its run id.  At the end a read_committed reader sees every id exactly once, the last stable offset is the
high watermark, and Kafka's own ``TransactionsCommand`` finds nothing open.

The batch job writes 100,000 ids; the streaming queries read JSON files (300 rows per batch in 3 partitions)
with Trigger.AvailableNow.  Each server life costs a JVM start (about 20-30 s on a loaded 2-core machine), so CI
runs the batch job killed once (after its decision); the batch job killed twice, the data source's stream killed
once, and both streaming paths killed three times (before a decision, after one, in the middle of its
completion) are ``campaign`` tests.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import kafka2pc.recipes.spark._datasource  # noqa: F401 - PySpark 4, or this module's collection fails naming it
import pytest
from _sparkkit import ConnectChain, assert_exactly_once, decision_outcomes, hanging, write_json_files
from harness.kafka_judge import assert_nothing_open
from harness.ports import spark_connect_server_port

from kafka2pc.testing import drain


def visible(bootstrap: str, topic: str) -> int:
    return len(drain(bootstrap, topic, "read_committed"))


@pytest.mark.parametrize("kills", [
    pytest.param(1, id="one-kill"),
    pytest.param(2, id="two-kills", marks=pytest.mark.campaign),  # one more server life, about 40 s
])
def test_batch_job_of_100k_ids_with_the_server_killed(
    kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path, kills: int
) -> None:
    """Killed after its decision (campaign: first after its tasks prepared); rerun: each id once, and again: none."""
    out = topic_factory(partitions=3)
    expected = write_json_files(tmp_path / "in", [10_000] * 10)
    prefix = f"k2pc-cx-{uuid.uuid4().hex[:6]}-"
    cfg = {
        "bootstrap": kafka_bootstrap, "out_topic": out, "sink": "datasource", "source": "batch",
        "files_dir": str(tmp_path / "in"), "run_id": "nightly-2026-11-28", "decision_path": str(tmp_path / "d"),
        "prefix": prefix,
    }
    chain = ConnectChain(tmp_path, spark_connect_server_port())
    if kills == 2:
        assert chain.crash(cfg, "after_prepare", 0, "run1") == "after_prepare 0"
        assert visible(kafka_bootstrap, out) == 0 and hanging(kafka_bootstrap, out) == 100_000
        assert not list((tmp_path / "d").rglob("0*.json"))  # no decision

    assert chain.crash(cfg, "after_decision", 0, "run2") == "after_decision 0"
    # (after run1) run2 aborted what run1 prepared before it wrote: only its own decided transactions are open.
    assert visible(kafka_bootstrap, out) == 0 and hanging(kafka_bootstrap, out) == 100_000

    # A new server finds the source by name (the installed pyspark_kafka2pc), completes the recorded
    # decision and writes nothing new; the second write of the same process finds the run committed.
    chain.finish(dict(cfg, auto_register=True, writes=2), "run3")
    assert (tmp_path / "run3.server.stderr").read_text().count("nightly-2026-11-28 was committed already") == 2
    assert_exactly_once(kafka_bootstrap, out, expected)
    assert len(drain(kafka_bootstrap, out, "read_uncommitted")) == 100_000 * kills  # with run1's aborted rows
    assert_nothing_open(kafka_bootstrap, prefix=prefix, topics=[out])
    assert chain.lives == kills + 1


@pytest.mark.parametrize(("sink", "kills"), [
    pytest.param("datasource", 1, id="datasource-one-kill", marks=pytest.mark.campaign),  # 93 s; CI kills the batch job
    # Two more server lives each, and the foreachBatch sink's path: about 2 min each.
    pytest.param("datasource", 3, id="datasource-three-kills", marks=pytest.mark.campaign),
    pytest.param("foreachBatch", 3, id="foreachBatch-three-kills", marks=pytest.mark.campaign),
])
def test_streaming_query_with_the_server_killed(
    kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path, sink: str, kills: int
) -> None:
    """Before a decision, after one, and in the middle of its completion (CI: after a decision); then to the end."""
    out = topic_factory(partitions=2)
    expected = write_json_files(tmp_path / "in", [100] * 15)
    chk = tmp_path / "chk"
    prefix = f"k2pc-cx-{uuid.uuid4().hex[:6]}-"
    cfg = {
        "bootstrap": kafka_bootstrap, "out_topic": out, "checkpoint": str(chk), "sink": sink,
        "source": "files", "files_dir": str(tmp_path / "in"), "files_per_batch": 3, "prefix": prefix,
    }
    chain = ConnectChain(tmp_path, spark_connect_server_port())
    if kills == 3:
        assert chain.crash(cfg, "after_prepare", 0, "run1") == "after_prepare 0"
        assert visible(kafka_bootstrap, out) == 0 and hanging(kafka_bootstrap, out) == 300
        assert not list((chk / "kafka2pc").rglob("0*.json"))  # no decision

    assert chain.crash(cfg, "after_decision", 1, "run2") == "after_decision 1"
    assert decision_outcomes(kafka_bootstrap, chk, 1) == ["prepared"] * 3
    assert visible(kafka_bootstrap, out) == 300 and hanging(kafka_bootstrap, out) == 300

    if kills == 3:
        assert chain.crash(cfg, "mid_completion", 1, "run3") == "mid_completion 1"  # batch 1 again, from its decision
        assert sorted(decision_outcomes(kafka_bootstrap, chk, 1)) == ["committed", "prepared", "prepared"]
        assert hanging(kafka_bootstrap, out) > 0

    metrics = chain.finish(dict(cfg, auto_register=True), "run4")
    if sink == "foreachBatch":  # relayed from the server's copy of the sink to the client's object
        assert [(m["batch_id"], m["replayed"]) for m in metrics] == [(1, True), (2, False), (3, False), (4, False)]
        assert metrics[0]["transactions_committed"] == 3  # one by the killed server, two by this one
    assert_exactly_once(kafka_bootstrap, out, expected)
    assert_nothing_open(kafka_bootstrap, prefix=prefix, topics=[out])
    assert chain.lives == kills + 1
