"""Repair after a driver crash when the replayed batch is cut differently.

A JSON-file batch (three 500-row files) is cut into partitions by the number
of cores: 1,000 + 500 rows under ``local[2]``, 500 + 500 + 500 under
``local[3]``.  The driver is killed right after the batch's decision is
durable; Kafka then aborts decided transactions (an operator force-terminates
one, or the short ``transaction.timeout.ms`` expires), and the query restarts
with a different partitioning.  The sink must either
rewrite exactly the recorded content or refuse loudly; never lose or
duplicate rows silently.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from _sparkkit import assert_exactly_once, crash_driver, fail_driver, finish_driver, hanging, write_json_files
from kafka2pc.recipes.spark import LocalDecisionStore

from kafka2pc import TransactionAdmin
from kafka2pc.testing import drain


def decision_of(checkpoint: Path, batch_id: int) -> list[tuple[int, int]]:
    """(partition, records) of each transaction the latest revision of ``batch_id``'s decision names."""
    (sink_dir,) = (checkpoint / "kafka2pc").iterdir()
    decision = LocalDecisionStore(sink_dir).get(batch_id)
    assert decision is not None
    return [(t.partition, t.records) for t in decision.transactions]


def wait_until_aborted_by_broker(bootstrap: str, topic: str, timeout: float = 90) -> None:
    """The broker aborts timed-out transactions on its cleanup timer (every 10 s by default)."""
    deadline = time.monotonic() + timeout
    while hanging(bootstrap, topic) and time.monotonic() < deadline:
        time.sleep(1)
    assert hanging(bootstrap, topic) == 0, "the broker did not abort the timed-out transactions"


def test_partial_loss_refused_then_repaired_and_a_timed_out_batch_rewritten_in_a_new_cut(
    kafka_bootstrap: str, topic_factory: Callable[..., str], tmp_path: Path
) -> None:
    """One checkpoint, two batches of three 500-row files, both killed after their decision.

    Batch 0: one decided transaction force-terminated (the operator variant),
    the other still prepared, and the restart cuts files smaller.  Rewriting
    "partition 0" of the new cut would lose some rows and duplicate others: the
    sink refuses, names what differs and what to do, and leaves nothing open.
    Restarted with the recorded partitioning, it repairs that one partition.

    Batch 1 (its producers with a short ``transaction.timeout.ms``): every
    decided transaction times out; the restart with more cores rewrites the
    whole batch in the new cut, after its content matched.
    """
    out = topic_factory(partitions=2)
    expected = write_json_files(tmp_path / "in", [500] * 6)  # two batches of three files
    chk = tmp_path / "chk"
    cfg = {
        "bootstrap": kafka_bootstrap, "out_topic": out, "checkpoint": str(chk),
        "source": "files", "files_dir": str(tmp_path / "in"), "files_per_batch": 3, "master": "local[2]",
    }
    assert crash_driver(cfg, tmp_path, "after_decision", 0, "run1") == "after_decision 0"
    recorded = decision_of(chk, 0)
    assert sorted(n for _, n in recorded) == [500, 1000]
    (sink_dir,) = (chk / "kafka2pc").iterdir()
    decision = LocalDecisionStore(sink_dir).get(0)
    assert decision is not None
    big = next(t for t in decision.transactions if t.records == 1000)
    with TransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:  # the operator variant
        assert admin.force_terminate_transaction(big.transactional_id) is not None
    with TransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:  # the other one is still prepared
        other = next(t for t in decision.transactions if t.records == 500)
        info = admin.describe_transaction(other.transactional_id)
        assert info is not None and info.is_open
    assert hanging(kafka_bootstrap, out) >= 500

    error = fail_driver(
        dict(cfg, spark_conf={"spark.sql.files.maxPartitionBytes": "8000"}), tmp_path, "run2"
    )
    assert "cannot repair" in error and "partitioning" in error, error
    assert f"p{big.partition}: 1000 rows" in error  # what the decision recorded
    committed = drain(kafka_bootstrap, out, "read_committed")
    assert len(committed) == 500 and len({r.value for r in committed}) == 500  # the surviving partition only
    assert hanging(kafka_bootstrap, out) == 0  # what the refused repair prepared was aborted
    assert decision_of(chk, 0) == recorded  # no new revision

    timing_out = dict(cfg, producer_config={"transaction.timeout.ms": 10000})
    assert crash_driver(timing_out, tmp_path, "after_decision", 1, "run3") == "after_decision 1"
    # Batch 0 was replayed first: the lost partition rewritten as recorded (a new revision), the other committed.
    assert "batch 0 (replay): 1500 records in 2 transactions" in (tmp_path / "run3.log").read_text()
    assert f"repaired [{big.partition}]" in (tmp_path / "run3.log").read_text()
    repaired = LocalDecisionStore(sink_dir).get(0)
    assert repaired is not None and repaired.revision == 1
    assert [(t.partition, t.records) for t in repaired.transactions] == recorded
    visible = [r.value for r in drain(kafka_bootstrap, out, "read_committed")]
    assert len(visible) == len(set(visible)) == 1500 and set(visible) <= set(expected)
    assert sorted(n for _, n in decision_of(chk, 1)) == [500, 1000]
    assert hanging(kafka_bootstrap, out) == 1500
    wait_until_aborted_by_broker(kafka_bootstrap, out)
    assert len(drain(kafka_bootstrap, out, "read_committed")) == 1500

    metrics = finish_driver(dict(cfg, master="local[3]"), tmp_path, "run4")
    assert (metrics[0]["batch_id"], metrics[0]["replayed"]) == (1, True)
    assert sorted(metrics[0]["repaired_partitions"]) == [0, 1]
    assert decision_of(chk, 1) == [(0, 500), (1, 500), (2, 500)]  # revision 1: the new cut
    assert_exactly_once(kafka_bootstrap, out, expected)
    assert json.loads((tmp_path / "run4.metrics.json").read_text())[-1]["batch_id"] == 1
