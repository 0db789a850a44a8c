"""``StallReport``'s figures from a known list of tick lateness (pure logic)."""

from __future__ import annotations

import pytest

from kafka2pc.aio import StallReport


def test_stalled_fraction_counts_the_stalls_not_the_timer_overshoot() -> None:
    # 1,000 ticks of 1 ms, each woken 0.4 ms late (a busy machine's timer), over 1.4 s: no stall.
    idle = StallReport(ticks=1_000, elapsed_s=1.4, lateness_s=[0.0004] * 1_000)
    assert idle.stalled_fraction == 0.0
    assert idle.max_stall_s == pytest.approx(0.0004)
    # The same, plus one call that held the loop 0.7 s: half the run was a stall.
    blocked = StallReport(ticks=1_001, elapsed_s=1.4, lateness_s=[0.0004] * 1_000 + [0.7])
    assert blocked.stalled_fraction == pytest.approx(0.5)
    assert blocked.over(0.1) == 1 and blocked.max_stall_s == pytest.approx(0.7)
    # A call blocking for 5 ms at each of 100 calls: 0.5 s of 1 s.
    many = StallReport(ticks=1_100, elapsed_s=1.0, lateness_s=[0.0002] * 1_000 + [0.005] * 100)
    assert many.stalled_fraction == pytest.approx(0.5)
    # The noise floor is the report's own setting.
    assert StallReport(ticks=1, elapsed_s=1.0, lateness_s=[0.0004], noise_s=0.0).stalled_fraction == pytest.approx(0.0004)


def test_an_empty_report_is_not_stalled() -> None:
    report = StallReport()
    assert report.stalled_fraction == 0.0 and report.max_stall_s == 0.0 and report.percentile_s(0.99) == 0.0


def test_the_rc1_names_still_work_and_warn() -> None:
    report = StallReport(ticks=2, elapsed_s=1.0, lateness_s=[0.2, 0.0004])
    with pytest.warns(DeprecationWarning, match="StallReport.elapsed.*elapsed_s"):
        assert report.elapsed == 1.0
    with pytest.warns(DeprecationWarning, match="StallReport.elapsed.*elapsed_s"):
        report.elapsed = 2.0
    assert report.elapsed_s == 2.0
    with pytest.warns(DeprecationWarning, match="lateness_s"):
        assert report.lateness is report.lateness_s
    with pytest.warns(DeprecationWarning, match="noise_s"):
        assert report.noise == report.noise_s
    with pytest.warns(DeprecationWarning, match="max_stall_s"):
        assert report.max_stall == report.max_stall_s == 0.2
    with pytest.warns(DeprecationWarning, match="percentile_s"):
        assert report.percentile(0.99) == report.percentile_s(0.99)
