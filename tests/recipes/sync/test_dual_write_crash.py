"""Crash matrix of the dual-write recipe: SIGKILL at every step of the normal path, then recover.

For each (crash point, database) a series of short-lived child processes
runs under one transactional id: each child recovers what the previous one
left, commits transactions, and kills itself with SIGKILL at the chosen step
of one of them.  The runs of a series go through every combination of the
killed transaction (the child's first, or one after a commit) and the bind
(a ``Connection`` or an ORM ``Session``, the recipe's two code paths): once
each where the outcome is deterministic, ``RACE_RUNS`` times where it is racy
(the kill during COMMIT).  Checked:

* the child really died at that step (exit by SIGKILL);
* the database outcome of the killed transaction is the one the step implies
  (committed from "DB committed" on, rolled back before COMMIT, either way
  while COMMIT is in flight);
* the next recovery decided what that outcome requires (commit the prepared
  transaction iff the database committed its state, abort a stray one,
  nothing when nothing was open);
* at the end (one more recovery in this process): every committed row has
  exactly one ``read_committed`` record and vice versa, and the
  ``read_committed`` end offset equals the ``read_uncommitted`` one.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from harness.crash_matrix import (
    PARALLEL,
    check_reports,
    crash_points,
    db_url_for,
    prepare_db,
    print_reports,
    run_matrix,
    run_recovery_kills,
    server_url,
)
from harness.dw_crash import Zygote, check_consistency
from kafka2pc.recipes.dual_write import DualWriter, define_outbox_table, define_state_table

from kafka2pc import HeuristicOutcomeError
from kafka2pc._control import ControlPlane
from kafka2pc.testing import create_topic


@pytest.fixture
def zygotes(tmp_path: Path) -> Iterator[list[Zygote]]:
    procs = [Zygote(tmp_path / f"zygote-{i}.log") for i in range(PARALLEL)]
    yield procs
    for z in procs:
        z.close()


@pytest.mark.slow
@pytest.mark.parametrize("db_kind", ["postgresql", "sqlite", "mariadb"])
def test_crash_matrix(
    db_kind: str, request: pytest.FixtureRequest, kafka_bootstrap: str, zygotes: list[Zygote], tmp_path: Path,
    seed: int,
) -> None:
    pg_url = server_url(request, db_kind)
    points = crash_points()
    reports = run_matrix(
        db_kind, points, zygotes, lambda p: db_url_for(db_kind, pg_url, tmp_path, p), kafka_bootstrap, tmp_path, seed
    )
    print_reports(reports)
    failures = [f"{r.point}/{r.db}: {f}" for r in reports for f in r.failures]
    assert not failures, "\n".join(failures)
    check_reports(reports, kafka_bootstrap)
    committing = next((r for r in reports if r.point == "db_committing"), None)
    if committing is None:  # narrowed by $KAFKA2PC_CRASH_POINTS
        return
    # Both sides of the COMMIT race were exercised, so both recovery branches ran.
    assert committing.decisions["commit"] + committing.decisions["abort"] == committing.runs
    assert committing.db_committed == committing.decisions["commit"]
    assert committing.decisions["commit"] >= 1 and committing.decisions["abort"] >= 1, (
        f"the kill during COMMIT landed on one side only in {committing.runs} runs: {dict(committing.decisions)}"
    )


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    z = Zygote(tmp_path / "zygote.log")
    yield z
    z.close()


@pytest.mark.parametrize("db_kind", ["postgresql", "sqlite", "mariadb"])
def test_kill_during_recovery_then_recover_again(
    db_kind: str, request: pytest.FixtureRequest, kafka_bootstrap: str, zygote: Zygote, tmp_path: Path
) -> None:
    """A recovery killed at any moment leaves nothing a later recovery cannot finish (idempotence)."""
    run_recovery_kills(db_kind, request, kafka_bootstrap, zygote, tmp_path)


def _wait_until_not_ongoing(bootstrap: str, tids: list[str], timeout: float = 60.0) -> None:
    """Wait for the broker to abort the timed-out transactions (the test broker checks every second)."""
    import time

    with ControlPlane({"bootstrap.servers": bootstrap}) as ctrl:
        deadline = time.monotonic() + timeout
        while True:
            states = {tid: getattr(ctrl.describe_transaction(tid), "state", None) for tid in tids}
            if all(state in ("CompleteAbort", "Empty") for state in states.values()):
                return
            assert time.monotonic() < deadline, f"the broker did not abort the timed-out transactions: {states}"
            time.sleep(0.5)


def test_heuristic_outcome_is_reported_and_retained_records_are_republished_once(
    pg_url: str, kafka_bootstrap: str, zygote: Zygote, tmp_path: Path
) -> None:
    """Owner down longer than transaction.timeout.ms: the broker aborts a transaction the database committed.

    Without ``retain_records`` recovery raises HeuristicOutcomeError (and the
    loss is exactly that transaction's records); with it, the records are
    re-published exactly once, even when the re-publishing process is itself
    killed half-way.
    """
    sqlite_url = f"sqlite:///{tmp_path / 'h.db'}"
    cases = {
        # name: (db url, retain, kill the first recovery at this step of the re-publish)
        "plain-pg": (pg_url, False, None),
        "retain-pg-killed-after-db-commit": (pg_url, True, "db_committed"),
        "retain-sqlite-killed-after-prepare": (sqlite_url, True, "prepared"),
        "retain-sqlite": (sqlite_url, True, None),
    }
    for url in {pg_url, sqlite_url}:
        prepare_db(url).dispose()
    setup: dict[str, dict[str, Any]] = {}
    for name, (url, retain, _) in cases.items():
        series = f"h-{name}-{uuid.uuid4().hex[:6]}"
        setup[name] = {
            "db_url": url, "bootstrap": kafka_bootstrap, "tid": f"dw-{series}", "topic": create_topic(kafka_bootstrap),
            "series": series, "results": str(tmp_path / f"{name}.jsonl"), "retain": retain,
            "transactions": 2, "records": 2,
        }
        crash = {**setup[name], "run": 0, "point": "db_committed", "crash_txn": 1,
                 "producer_config": {"transaction.timeout.ms": 5000}}
        assert zygote.run(crash) == -9
    _wait_until_not_ongoing(kafka_bootstrap, [job["tid"] for job in setup.values()])

    for name, (url, retain, kill_at) in cases.items():
        job = setup[name]
        if kill_at is not None:
            assert zygote.run({**job, "run": 1, "recover_only": True, "recovery_point": kill_at}) == -9
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        metadata = sa.MetaData()
        writer = DualWriter(
            engine, {"bootstrap.servers": kafka_bootstrap, "transactional.id": job["tid"]},
            state_table=define_state_table(metadata), outbox_table=define_outbox_table(metadata), retain_records=retain,
        )
        if not retain:
            with pytest.raises(HeuristicOutcomeError) as info:
                writer.recover()
            assert info.value.transactional_id == job["tid"] and info.value.outcome == "aborted"
            assert writer.metrics().heuristic_outcomes == 1
            rows, records, problems = check_consistency(engine, kafka_bootstrap, job["topic"], job["series"])
            # Exactly the heuristic transaction's two records are missing, and nothing hangs.
            assert (rows, records) == (4, 2)
            assert len(problems) == 1 and problems[0].startswith("committed rows without a record")
            assert ":0-1-0" in problems[0]
            again = writer.recover(on_heuristic="report")  # reported again, idempotent, still ready
            assert again.heuristic and again.republished == 0
        else:
            result = writer.recover()
            if kill_at == "db_committed":
                # The killed re-publish had committed its new state: recovery commits it.
                assert result.settlement is not None and result.settlement.plan.decision.value == "commit"
                assert not result.heuristic and result.republished == 0
            else:
                assert result.heuristic and result.republished == 2
            rows, records, problems = check_consistency(engine, kafka_bootstrap, job["topic"], job["series"])
            assert not problems, (name, problems)
            assert rows == records == 4
            outbox = define_outbox_table(sa.MetaData())
            with engine.connect() as conn:
                left = conn.execute(
                    sa.select(sa.func.count()).select_from(outbox).where(outbox.c.transactional_id == job["tid"])
                ).scalar_one()
            assert left == (0 if result.republished == 0 else 2)  # deleted lazily by the next transaction
        writer.close()
        engine.dispose()
