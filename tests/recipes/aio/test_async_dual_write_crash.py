"""Crash matrix of the asyncio dual write: SIGKILL at every named step, normal path and recovery.

The sync recipe's matrix (``recipes/sync/test_dual_write_crash.py``), run unchanged by
its series runner (``harness/crash_matrix.py``), with children that run :class:`AsyncDualWriter` on an
event loop (``harness/adw_crash.py``): each child recovers what the previous one
left (with the async writer), commits transactions on an ``AsyncSession`` or
an ``AsyncConnection``, and is killed at the chosen step of one of them.
Checked per (step, database): the child died there, the database outcome is
the one the step implies, the next recovery decided what that outcome
requires, and at the end every committed row has exactly one
``read_committed`` record and vice versa, with nothing left hanging.
The last recovery of each series is the sync writer's: the two read and
settle each other's state rows.

``KAFKA2PC_AIO_CRASH_RUNS`` children per (step, database): 4 by default,
one per (killed transaction: first or after a commit) x (``AsyncConnection``
or ``AsyncSession``), 20 for the full run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import harness.crash_matrix as matrix
import pytest
from harness.adw_crash import AsyncZygote

RUNS = int(os.environ.get("KAFKA2PC_AIO_CRASH_RUNS", str(len(matrix.COMBINATIONS))))


@pytest.fixture
def async_zygotes(tmp_path: Path) -> Iterator[list[AsyncZygote]]:
    procs = [AsyncZygote(tmp_path / f"zygote-{i}.log") for i in range(matrix.PARALLEL)]
    yield procs
    for z in procs:
        z.close()


@pytest.fixture
def async_zygote(tmp_path: Path) -> Iterator[AsyncZygote]:
    z = AsyncZygote(tmp_path / "zygote.log")
    yield z
    z.close()


@pytest.mark.parametrize("db_kind", ["postgresql", "sqlite"])
def test_async_crash_matrix_at_every_step(
    db_kind: str, request: pytest.FixtureRequest, kafka_bootstrap: str, async_zygotes: list[AsyncZygote],
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int,
) -> None:
    monkeypatch.setattr(matrix, "RUNS", RUNS)
    monkeypatch.setattr(matrix, "RACE_RUNS", RUNS)
    pg_url = matrix.server_url(request, db_kind)
    points = list(matrix.EXPECTED)
    reports = matrix.run_matrix(
        db_kind, points, async_zygotes,  # type: ignore[arg-type]
        lambda p: matrix.db_url_for(db_kind, pg_url, tmp_path, f"async-{p}"), kafka_bootstrap, tmp_path, seed,
    )
    matrix.print_reports(reports)
    failures = [f"{r.point}/{r.db}: {f}" for r in reports for f in r.failures]
    assert not failures, "\n".join(failures)
    matrix.check_reports(reports, kafka_bootstrap)
    committed = {r.point: r.db_committed for r in reports}
    assert committed["db_committed"] == committed["kafka_committed"] == RUNS  # the decision point
    assert committed["state_stored"] == committed["prepared"] == 0


@pytest.mark.parametrize("db_kind", ["postgresql", "sqlite"])
def test_async_recovery_killed_at_every_step_is_finished_by_the_next(
    db_kind: str, request: pytest.FixtureRequest, kafka_bootstrap: str, async_zygote: AsyncZygote, tmp_path: Path,
) -> None:
    """The recovery's own steps (locked, claimed, settled) and timed kills inside it, with async children."""
    matrix.run_recovery_kills(db_kind, request, kafka_bootstrap, async_zygote, tmp_path)
