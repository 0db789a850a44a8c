"""The repair check and the content fingerprint, as pure functions (no Spark, no broker)."""

from __future__ import annotations

from kafka2pc.recipes.spark._completion import repair_mismatch
from kafka2pc.recipes.spark._values import PartitionResult, SinkDecision, SinkTransaction, combine_fingerprints


def txn(partition: int, records: int, fingerprint: str | None) -> SinkTransaction:
    return SinkTransaction(partition, f"t-{partition}", "k2pc1:5:0:0a1b2c3d:0:17:out", records, fingerprint)


def replayed(partition: int, records: int, fingerprint: str, written: bool = True) -> PartitionResult:
    return PartitionResult(partition, 0, f"t-{partition}" if written else "", "s" if written else "", records,
                           0.0, 0.0, 0.0, fingerprint)


def test_fingerprints_add_up_modulo_2_64_in_any_order() -> None:
    rows = [2**63 - 5, -(2**63), 17, -1, 12345678901234]
    whole = combine_fingerprints(rows)
    assert whole == combine_fingerprints(list(reversed(rows)))
    assert whole == combine_fingerprints([combine_fingerprints(rows[:2]), combine_fingerprints(rows[2:])])
    assert len(whole) == 16 and combine_fingerprints([]) == "0" * 16
    assert combine_fingerprints(rows[1:]) != whole


def test_partial_repair_needs_every_partition_as_recorded() -> None:
    recorded = [txn(0, 1000, "00000000000000aa"), txn(1, 500, "00000000000000bb")]
    same = [replayed(0, 1000, "00000000000000aa"), replayed(1, 500, "00000000000000bb", written=False)]
    assert repair_mismatch(recorded, same, whole_batch=False) is None
    recut = [replayed(0, 500, "0000000000000011"), replayed(1, 500, "0000000000000022", written=False),
             replayed(2, 500, "0000000000000033", written=False)]
    problem = repair_mismatch(recorded, recut, whole_batch=False)
    assert problem is not None and "p0: 1000 rows" in problem and "p2: 500 rows" in problem
    changed = [replayed(0, 1000, "00000000000000ab"), replayed(1, 500, "00000000000000bb", written=False)]
    assert repair_mismatch(recorded, changed, whole_batch=False) is not None  # same counts, other rows
    old = [txn(0, 1000, None), txn(1, 500, None)]  # a decision written before fingerprints: counts only
    assert repair_mismatch(old, changed, whole_batch=False) is None


def test_whole_batch_repair_needs_the_same_content_in_any_cut() -> None:
    recorded = [txn(0, 1000, combine_fingerprints([1, 2])), txn(1, 500, combine_fingerprints([3]))]
    recut = [replayed(p, 500, combine_fingerprints([v])) for p, v in enumerate([1, 2, 3])]
    assert repair_mismatch(recorded, recut, whole_batch=True) is None
    other = [replayed(p, 500, combine_fingerprints([v])) for p, v in enumerate([1, 2, 4])]
    assert "differ" in (repair_mismatch(recorded, other, whole_batch=True) or "")
    fewer = recut[:2]
    assert "1000" in (repair_mismatch(recorded, fewer, whole_batch=True) or "")


def test_decisions_keep_fingerprints_and_read_old_ones() -> None:
    decision = SinkDecision("x", 3, 0, (txn(0, 10, "00000000000000ff"),), 1)
    assert SinkDecision.from_json(decision.to_json()) == decision
    old = (b'{"format": "kafka2pc-spark-decision/1", "sink_id": "x", "batch_id": 3, "revision": 0, '
           b'"transactions": [{"partition": 0, "transactional_id": "t-0", '
           b'"state": "k2pc1:5:0:0a1b2c3d:0:17:out", "records": 10}]}')
    assert SinkDecision.from_json(old).transactions[0].fingerprint is None
