"""Kill -9 the driver of a format("kafka2pc") write (Python driver + JVM + its Python workers) and run it again.

Streaming: one chain of driver processes on one checkpoint, killed after
the first batch's decision (CI) or, in the ``campaign`` run, before a
decision, after it and in the middle of its completion (and twice more:
after a second batch's decision and before a third's), then run to the end through the data source PySpark registers by
itself (``pyspark_kafka2pc``).  Batch: a job killed after its decision,
rerun with the same run id (a further rerun after a committed run is
test_spark_datasource.py's; a ``campaign`` test, as CI kills the same batch
job's Spark Connect server in test_spark_connect_crash.py).  Between kills the test checks what a
read_committed reader may see; at the end that it sees every input row exactly
once and that nothing is left hanging.  The kill points are the data source's
``_on_step`` test seam, which runs in the driver's commit worker.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import kafka2pc.recipes.spark._datasource  # noqa: F401 - PySpark 4, or this module's collection fails naming it
import pytest
from _sparkkit import assert_exactly_once, crash_driver, decision_outcomes, finish_driver, hanging, write_json_files

from kafka2pc.testing import drain


def visible(bootstrap: str, topic: str) -> int:
    return len(drain(bootstrap, topic, "read_committed"))


@pytest.mark.parametrize("kills", [
    pytest.param(1, id="one-kill"),  # two driver lives, about 90 s
    pytest.param(3, id="three-kills", marks=pytest.mark.campaign),  # about 185 s
    pytest.param(5, id="five-kills", marks=pytest.mark.campaign),  # two more driver lives: about 150 s more
])
def test_streaming_survives_driver_kills(
    kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path, kills: int
) -> None:
    """AvailableNow over JSON files, 300 rows per batch in 3 partitions (3 transactions), 5 batches.

    One kill (CI): after the first batch's decision.  Three: before a decision, after it and in the
    middle of its completion.  Five: also after a second batch's decision and before a third's."""
    out = topic_factory(partitions=2)
    expected = write_json_files(tmp_path / "in", [100] * 15)
    chk = tmp_path / "chk"
    cfg = {
        "bootstrap": kafka_bootstrap, "out_topic": out, "checkpoint": str(chk), "sink": "datasource",
        "source": "files", "files_dir": str(tmp_path / "in"), "files_per_batch": 3, "master": "local[3,4]",
    }
    if kills == 1:
        assert crash_driver(cfg, tmp_path, "after_decision", 0, "run1") == "after_decision 0"
        assert decision_outcomes(kafka_bootstrap, chk, 0) == ["prepared"] * 3
        assert visible(kafka_bootstrap, out) == 0 and hanging(kafka_bootstrap, out) == 300
    else:
        assert crash_driver(cfg, tmp_path, "after_prepare", 0, "run1") == "after_prepare 0"
        assert visible(kafka_bootstrap, out) == 0 and hanging(kafka_bootstrap, out) == 300
        assert not list((chk / "kafka2pc").rglob("0*.json"))  # no decision

        assert crash_driver(cfg, tmp_path, "after_decision", 1, "run2") == "after_decision 1"
        assert decision_outcomes(kafka_bootstrap, chk, 1) == ["prepared"] * 3
        assert visible(kafka_bootstrap, out) == 300 and hanging(kafka_bootstrap, out) == 300

        assert crash_driver(cfg, tmp_path, "mid_completion", 1, "run3") == "mid_completion 1"  # its replay
        assert sorted(decision_outcomes(kafka_bootstrap, chk, 1)) == ["committed", "prepared", "prepared"]
        assert hanging(kafka_bootstrap, out) > 0  # the replay's own transactions are open too

    if kills == 5:
        assert crash_driver(cfg, tmp_path, "after_decision", 2, "run4") == "after_decision 2"
        assert visible(kafka_bootstrap, out) == 600 and hanging(kafka_bootstrap, out) == 300

        assert crash_driver(cfg, tmp_path, "after_prepare", 3, "run5") == "after_prepare 3"
        assert visible(kafka_bootstrap, out) == 900 and hanging(kafka_bootstrap, out) >= 300

    finish_driver(dict(cfg, auto_register=True), tmp_path, "run6")  # format("kafka2pc") found by PySpark alone
    assert_exactly_once(kafka_bootstrap, out, expected)


@pytest.mark.campaign  # two driver lives, about 90 s; in CI the Spark Connect batch job is killed after its decision
def test_batch_job_killed_after_its_decision_then_rerun(
    kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path
) -> None:
    out = topic_factory(partitions=2)
    expected = write_json_files(tmp_path / "in", [100] * 6)
    cfg = {
        "bootstrap": kafka_bootstrap, "out_topic": out, "sink": "datasource", "source": "batch",
        "files_dir": str(tmp_path / "in"), "run_id": "nightly-2026-11-25", "decision_path": str(tmp_path / "d"),
        "master": "local[3,4]",
    }
    assert crash_driver(cfg, tmp_path, "after_decision", 0, "run1") == "after_decision 0"
    assert visible(kafka_bootstrap, out) == 0 and hanging(kafka_bootstrap, out) == 600

    finish_driver(cfg, tmp_path, "run2")  # completes the recorded decision, writes nothing new
    assert "nightly-2026-11-25 was committed already" in (tmp_path / "run2.stderr").read_text()
    assert_exactly_once(kafka_bootstrap, out, expected)
    assert len(drain(kafka_bootstrap, out, "read_uncommitted")) == 600
