"""The acknowledged-write log of the crash tests (tests/harness/acks.py): its format and its check."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.acks import AckLog, assert_acknowledged, check_acknowledged


def test_recorded_ids_read_back_in_order_and_a_torn_line_is_dropped(tmp_path: Path) -> None:
    log = AckLog(tmp_path / "acks")
    assert log.ids() == []
    for i in (3, 1, 2):
        log.record(i)
    with open(log.path, "a") as f:
        f.write("4")  # a kill inside record(): the line has no newline yet
    assert log.ids() == ["3", "1", "2"]


def test_a_multi_line_id_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        AckLog(tmp_path / "acks").record("a\nb")


def test_a_write_lost_on_both_sides_is_caught() -> None:
    # rows == records (both empty of id 2), yet 2 was acknowledged.
    failures = check_acknowledged(["1", "2"], db_ids=[1], kafka_ids=[1])
    assert any("2 is not in the database" in f for f in failures)
    assert any("2 has 0 read_committed" in f for f in failures)


def test_a_duplicate_record_is_caught() -> None:
    assert check_acknowledged(["1"], db_ids=[1], kafka_ids=[1, 1]) == [
        "acknowledged id 1 has 2 read_committed records, not 1"
    ]


def test_kept_writes_pass_and_unacknowledged_extras_are_allowed() -> None:
    assert assert_acknowledged(["1", "2"], db_ids=[1, 2, 3], kafka_ids=[2, 1, 3]) == 2
