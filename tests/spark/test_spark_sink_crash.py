"""Kill -9 the Spark driver (Python driver + JVM, the whole process group) at each step of the 2PC, restart.

Each scenario is one chain of driver processes on one checkpoint: crash after
the tasks prepared (no decision yet), crash after the decision is durable
(nothing committed), crash in the middle of completion (one transaction
committed, one not), then a clean run to the end.  Between crashes the test
checks what a read_committed reader may see at that point; at the end that it
sees every input row exactly once and that nothing is left hanging.

The file-source chain (Trigger.AvailableNow, three transactions per batch)
is a ``campaign`` test: its kill points are the rate-source chain's, and
test_spark_datasource_crash.py kills an AvailableNow file query at the same
points through the same protocol (``_protocol.SinkCoordinator``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from _sparkkit import (
    assert_exactly_once,
    crash_driver,
    decision_outcomes,
    finish_driver,
    hanging,
    write_json_files,
)

from kafka2pc.testing import drain


def committed_values(bootstrap: str, topic: str) -> list[bytes]:
    return sorted(r.value for r in drain(bootstrap, topic, "read_committed") if r.value is not None)


def nums(lo: int, hi: int) -> list[bytes]:
    return sorted(str(i).encode() for i in range(lo, hi))


def test_rate_source_survives_driver_kills_at_every_step(
    kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path
) -> None:
    rows = 400
    out = topic_factory(partitions=2)
    cfg = {
        "bootstrap": kafka_bootstrap, "out_topic": out, "checkpoint": str(tmp_path / "chk"),
        "source": "rate", "rows_per_batch": rows, "last_batch": 4,
    }

    assert crash_driver(cfg, tmp_path, "after_prepare", 1, "run1") == "after_prepare 1"
    assert committed_values(kafka_bootstrap, out) == nums(0, rows)  # batch 1 prepared, not visible
    assert hanging(kafka_bootstrap, out) == rows
    assert not list((tmp_path / "chk" / "kafka2pc").rglob("0000000000000000001.*.json"))

    assert crash_driver(cfg, tmp_path, "after_decision", 2, "run2") == "after_decision 2"
    assert committed_values(kafka_bootstrap, out) == nums(0, 2 * rows)  # batch 1 rewritten, batch 2 decided
    assert hanging(kafka_bootstrap, out) == rows
    assert list((tmp_path / "chk" / "kafka2pc").rglob("0000000000000000002.000000.json"))

    assert crash_driver(cfg, tmp_path, "mid_completion", 3, "run3") == "mid_completion 3"
    # One of batch 3's transactions committed, the other is still prepared: it holds back the last
    # stable offset, so a reader sees batches 0-2 and, at most, part of the committed one.
    assert decision_outcomes(kafka_bootstrap, tmp_path / "chk", 3) == ["committed", "prepared"]
    visible = committed_values(kafka_bootstrap, out)
    assert len(set(visible)) == len(visible) and set(nums(0, 3 * rows)) <= set(visible) <= set(nums(0, 4 * rows))
    assert hanging(kafka_bootstrap, out) > 0

    metrics = finish_driver(cfg, tmp_path, "run4")
    assert [(m["batch_id"], m["replayed"]) for m in metrics] == [(3, True), (4, False)]
    assert metrics[0]["transactions_committed"] == 2  # one by the killed driver, one by this one
    assert_exactly_once(kafka_bootstrap, out, nums(0, 5 * rows))


@pytest.mark.campaign
def test_file_source_survives_driver_kills(
    kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path
) -> None:
    """Trigger.AvailableNow over JSON files (300 rows per batch, cut into 3 partitions), killed twice."""
    out = topic_factory(partitions=2)
    n = 1500
    expected = sorted(write_json_files(tmp_path / "in", [100] * 15))
    cfg = {
        "bootstrap": kafka_bootstrap, "out_topic": out, "checkpoint": str(tmp_path / "chk"),
        "source": "files", "files_dir": str(tmp_path / "in"), "files_per_batch": 3,
        "master": "local[3,4]",
    }

    assert crash_driver(cfg, tmp_path, "after_decision", 1, "run1") == "after_decision 1"
    assert len(committed_values(kafka_bootstrap, out)) == 300 and hanging(kafka_bootstrap, out) == 300

    assert crash_driver(cfg, tmp_path, "mid_completion", 3, "run2") == "mid_completion 3"
    assert decision_outcomes(kafka_bootstrap, tmp_path / "chk", 3) == ["committed", "prepared", "prepared"]
    assert len(committed_values(kafka_bootstrap, out)) >= 900 and hanging(kafka_bootstrap, out) > 0

    metrics = finish_driver(cfg, tmp_path, "run3")
    assert metrics[0]["batch_id"] == 3 and metrics[0]["replayed"]
    assert sum(m["records"] for m in metrics) == n - 900
    assert_exactly_once(kafka_bootstrap, out, expected)
