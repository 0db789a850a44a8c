"""The dual-write crash matrix's machinery: series of zygote children killed at a step, then verified.

``recipes/sync/test_dual_write_crash.py`` runs it with :class:`harness.dw_crash.Zygote`
children (the sync writer), ``recipes/aio/test_async_dual_write_crash.py`` with
:class:`harness.adw_crash.AsyncZygote` children (the asyncio writer): the jobs,
the expected outcomes and the checks are the same.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kafka2pc.recipes.dual_write import DualWriter, define_outbox_table, define_state_table

from harness.acks import AckLog
from harness.dw_crash import RACE_DELAY_EARLY, RACE_DELAY_LATE, Zygote, check_consistency, items_table
from harness.kafka_judge import assert_nothing_open
from kafka2pc.testing import create_topic

#: (index of the killed transaction, ORM Session rather than Connection): every run takes the next.
COMBINATIONS: list[tuple[int, bool]] = [(crash_txn, session) for session in (False, True) for crash_txn in (0, 1)]
#: Runs at a deterministic kill point: each combination once.
RUNS = int(os.environ.get("KAFKA2PC_CRASH_RUNS", str(len(COMBINATIONS))))
#: Runs at the racy kill point (during COMMIT); more, up to ``RACE_RUNS_LIMIT`` times as many, while one
#: side of the race has not occurred yet (on PostgreSQL about 1 kill in 7 lands before the COMMIT).  Those
#: extra runs draw the kill's delay from the end of the range that favours the missing side
#: (``race_delay``): still a race, but one that a loaded machine cannot keep on one side for 40 runs.
RACE_RUNS = int(os.environ.get("KAFKA2PC_CRASH_RACE_RUNS", "20"))
RACE_RUNS_LIMIT = 3
RACY_POINTS = frozenset({"db_committing"})
PARALLEL = 3

#: crash point -> (database outcome of the killed transaction, recovery decisions allowed).
#: The outcome is True (committed), False (rolled back) or None (either).  None as a
#: decision set means "commit iff the database committed, else abort".
EXPECTED: dict[str, tuple[bool | None, frozenset[str] | None]] = {
    "db_begun": (False, frozenset({"nothing"})),
    "kafka_begun": (False, frozenset({"nothing"})),
    "produced": (False, frozenset({"nothing", "abort"})),
    "body_done": (False, frozenset({"nothing", "abort"})),
    "prepared": (False, frozenset({"abort"})),
    "state_stored": (False, frozenset({"abort"})),
    "db_committing": (None, None),
    "db_committed": (True, frozenset({"commit"})),
    "kafka_committed": (True, frozenset({"nothing"})),
}
#: Kill points of a pipelined pool only (``job["pipelined"]``), as ``EXPECTED``. ``responded``: the block
#: returned (the write is acknowledged) and the child dies at once, its Kafka commit held in the
#: background before it sent anything; the next recovery commits it.
PIPELINED_EXPECTED: dict[str, tuple[bool | None, frozenset[str] | None]] = {
    "responded": (True, frozenset({"commit"})),
}


@dataclass
class SeriesReport:
    point: str
    db: str
    runs: int = 0
    db_committed: int = 0
    decisions: Counter[str] = field(default_factory=Counter)
    combinations: Counter[tuple[int, bool]] = field(default_factory=Counter)
    rows: int = 0
    records: int = 0
    acknowledged: int = 0
    tid: str = ""
    topic: str = ""
    pipelined: bool = False
    in_flight_kills: int = 0
    """Kills at ``responded`` with the killed block's Kafka commit seen still in flight (the child's log)."""
    failures: list[str] = field(default_factory=list)


def runs_at(point: str) -> int:
    """Children per series at ``point``: every (transaction, bind) combination, more where the outcome is racy."""
    return max(RACE_RUNS if point in RACY_POINTS else RUNS, len(COMBINATIONS))


def _another_run(point: str, run: int, outcomes: list[bool]) -> bool:
    """Whether run number ``run`` of the series at ``point`` is due (see ``RACE_RUNS``)."""
    if run < runs_at(point):
        return True
    return point in RACY_POINTS and len(set(outcomes)) < 2 and run < RACE_RUNS_LIMIT * runs_at(point)


def crash_points() -> list[str]:
    """The kill points of the matrix: all of ``EXPECTED``, or those named in ``$KAFKA2PC_CRASH_POINTS``."""
    named = [p for p in os.environ.get("KAFKA2PC_CRASH_POINTS", "").split(",") if p]
    unknown = sorted(set(named) - set(EXPECTED))
    if unknown:
        raise ValueError(f"KAFKA2PC_CRASH_POINTS names unknown kill points {unknown}; known: {list(EXPECTED)}")
    return named or list(EXPECTED)


def db_url_for(kind: str, pg_url: str, tmp_path: Path, name: str) -> str:
    """``pg_url`` is the server database's URL (PostgreSQL or MariaDB); SQLite gets a file per name."""
    return pg_url if kind != "sqlite" else f"sqlite:///{tmp_path / f'{name}.db'}"


def server_url(request: pytest.FixtureRequest, db_kind: str) -> str:
    fixture = {"postgresql": "pg_url", "mariadb": "mariadb_url"}.get(db_kind)
    return str(request.getfixturevalue(fixture)) if fixture else ""


def prepare_db(url: str) -> sa.Engine:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    metadata = sa.MetaData()
    define_state_table(metadata)
    define_outbox_table(metadata)
    items_table(metadata)
    metadata.create_all(engine)
    return engine


def recover_here(engine: sa.Engine, bootstrap: str, tid: str) -> dict[str, Any]:
    writer = DualWriter(engine, {"bootstrap.servers": bootstrap, "transactional.id": tid},
                        state_table=define_state_table(sa.MetaData()))
    try:
        result = writer.recover(on_heuristic="report")
    finally:
        writer.close()
    assert result.settlement is not None
    return {"decision": result.settlement.plan.decision.value, "heuristic": result.heuristic}


def _row_exists(engine: sa.Engine, rid: str) -> bool:
    items = items_table(sa.MetaData())
    with engine.connect() as conn:
        return conn.execute(sa.select(items.c.id).where(items.c.id == rid)).first() is not None


def run_series(
    zygote: Zygote, point: str, db_kind: str, url: str, bootstrap: str, workdir: Path, seed: int,
    job_extra: dict[str, Any] | None = None,
) -> SeriesReport:
    """One (point, database) series: ``runs_at(point)`` children, each killed at ``point``; then verify.

    ``job_extra`` goes into every child's job (``{"pipelined": True}``: the Django children's pool pipelines).
    """
    job_extra = job_extra or {}
    rng = random.Random(seed)
    series = f"{point}-{db_kind}-{uuid.uuid4().hex[:6]}"
    tid = f"dw-crash-{series}"
    topic = create_topic(bootstrap)
    results = workdir / f"{series}.jsonl"
    acks = AckLog(workdir / f"{series}.acks")
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    report = SeriesReport(point, db_kind, tid=tid, topic=topic, pipelined=bool(job_extra.get("pipelined")))
    want_outcome, allowed = EXPECTED[point] if point in EXPECTED else PIPELINED_EXPECTED[point]
    outcomes: list[bool] = []
    try:
        for run in itertools.count():
            if not _another_run(point, run, outcomes):
                break
            crash_txn, session = COMBINATIONS[run % len(COMBINATIONS)]
            report.combinations[(crash_txn, session)] += 1
            job = {
                "db_url": url, "bootstrap": bootstrap, "tid": tid, "topic": topic, "series": series,
                "results": str(results), "ack_log": str(acks.path), "run": run, "point": point, "crash_txn": crash_txn, "session": session,
                "transactions": 2, "records": 2, "seed": rng.randrange(1 << 30), **job_extra,
            }
            if point in RACY_POINTS and run >= runs_at(point) and outcomes:
                job["race_delay"] = RACE_DELAY_EARLY if outcomes[0] else RACE_DELAY_LATE
            code = zygote.run(job)
            if code != -9:
                report.failures.append(f"run {run}: child exited {code}, not by SIGKILL at {point}")
                break
            committed = _row_exists(engine, f"{series}:{run}-{crash_txn}-0")
            outcomes.append(committed)
            report.runs += 1
            report.db_committed += committed
            if want_outcome is not None and committed is not want_outcome:
                report.failures.append(f"run {run}: killed at {point}, database committed={committed}")
        final = getattr(zygote, "final_recovery", recover_here)(engine, bootstrap, tid)
        seen = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
        decisions = [r["decision"] for r in sorted(seen, key=lambda r: r["run"])][1:] + [final["decision"]]
        for run, (committed, decision) in enumerate(zip(outcomes, decisions)):
            report.decisions[decision] += 1
            ok = allowed if allowed is not None else frozenset({"commit" if committed else "abort"})
            if decision not in ok:
                report.failures.append(
                    f"run {run}: killed at {point} (database committed={committed}); recovery decided "
                    f"{decision}, expected one of {sorted(ok)}"
                )
        if any(r["heuristic"] for r in seen) or final["heuristic"]:
            report.failures.append("a recovery reported a heuristic outcome")
        in_flight = Path(f"{results}.inflight")
        if in_flight.exists():
            report.in_flight_kills = sum(json.loads(line)["in_flight"] > 0 for line in in_flight.read_text().splitlines())
        report.rows, report.records, problems = check_consistency(engine, bootstrap, topic, series, acks)
        report.acknowledged = len(acks.ids())
        report.failures.extend(problems)
    finally:
        engine.dispose()
    return report



def run_matrix(
    db_kind: str, points: list[str], zygotes: list[Zygote], url_for: Callable[[str], str],
    bootstrap: str, tmp_path: Path, seed: int, job_extra: dict[str, Any] | None = None,
) -> list[SeriesReport]:
    """Every point's series, ``PARALLEL`` at a time; ``seed`` (the test's) draws the kills' delays;
    ``job_extra`` as :func:`run_series`."""
    free = list(zygotes)
    jobs = []
    for i, point in enumerate(points):
        url = url_for(point)
        prepare_db(url).dispose()
        jobs.append((point, url, seed + i))

    def one(args: tuple[str, str, int]) -> SeriesReport:
        point, url, seed = args
        z = free.pop()
        try:
            return run_series(z, point, db_kind, url, bootstrap, tmp_path, seed, job_extra)
        finally:
            free.append(z)

    with ThreadPoolExecutor(PARALLEL) as pool:
        return list(pool.map(one, jobs))


def print_reports(reports: list[SeriesReport]) -> None:
    print(f"\n{'point':<16}{'db':<12}{'runs':>5}{'db committed':>14}  recovery decisions{'':<14}rows  records  acked")
    for r in reports:
        decisions = ", ".join(f"{k} {v}" for k, v in sorted(r.decisions.items()))
        in_flight = f"  (killed with the commit in flight: {r.in_flight_kills})" if r.point == "responded" else ""
        print(f"{r.point:<16}{r.db:<12}{r.runs:>5}{r.db_committed:>14}  {decisions:<32}{r.rows:>4}  {r.records:>7}"
              f"  {r.acknowledged:>5}{in_flight}")


def check_reports(reports: list[SeriesReport], bootstrap: str, *, tid_is_prefix: bool = False) -> None:
    """Every series ran all its children, through every (transaction, bind) combination, and wrote rows.

    The children that were killed in their second transaction had their first acknowledged (two
    records each): the acknowledged-write check (``check_consistency``'s ``acks``) had ids to check.
    ``tid_is_prefix``: a series' ``tid`` is the prefix of a pool's ids (the Django children), not one id.
    """
    for r in reports:
        limit = runs_at(r.point) * (RACE_RUNS_LIMIT if r.point in RACY_POINTS else 1)
        assert runs_at(r.point) <= r.runs <= limit, (r.point, r.runs)
        assert set(r.combinations) == set(COMBINATIONS), (r.point, dict(r.combinations))
        assert r.rows > 0 and r.rows == r.records
        killed_second = sum(n for (crash_txn, _), n in r.combinations.items() if crash_txn == 1)
        if r.point == "responded":  # the killed block returned: it was acknowledged as well
            assert r.acknowledged == 2 * killed_second + 2 * r.runs, (r.point, r.acknowledged, killed_second)
            assert r.in_flight_kills > 0, f"{r.point}/{r.db}: no kill landed with a Kafka commit in flight"
        elif r.pipelined and r.point == "kafka_committed":  # killed in the background: its block may have returned
            assert 2 * killed_second <= r.acknowledged <= 2 * killed_second + 2 * r.runs, (r.point, r.acknowledged)
        else:
            assert r.acknowledged == 2 * killed_second, (r.point, r.acknowledged, killed_second)
    # Kafka's own tool agrees that no series left a transaction open (once for all series: a JVM per call).
    tids = [r.tid for r in reports]
    if tid_is_prefix:
        verdict = assert_nothing_open(bootstrap, prefix=[f"{t}-" for t in tids], topics=[r.topic for r in reports])
        # every series' pool reached a coordinator
        assert all(any(s.startswith(f"{t}-") for s in verdict.states) for t in tids), verdict.states
        return
    verdict = assert_nothing_open(bootstrap, tids, topics=[r.topic for r in reports])
    assert set(verdict.states) == set(tids), verdict.states  # every id reached its coordinator


#: How the recovering child dies -> decisions the next recovery may take.
RECOVERY_KILLS: list[tuple[dict[str, Any], frozenset[str]]] = [
    ({"recovery_point": "recovery_locked"}, frozenset({"commit"})),      # before it settled Kafka
    ({"recovery_point": "recovery_claimed"}, frozenset({"commit"})),     # claim committed, Kafka untouched
    ({"recovery_point": "recovery_settled"}, frozenset({"nothing"})),    # Kafka settled, DB not committed
    # Timed kills: somewhere in the control-plane calls, EndTxn, or the new producer's init.
    *[({"recovery_kill_after_s": delay}, frozenset({"commit", "nothing"})) for delay in (0.02, 0.05, 0.08, 0.12, 0.3)],
]


def run_recovery_kills(
    db_kind: str, request: pytest.FixtureRequest, kafka_bootstrap: str, zygote: Zygote, tmp_path: Path
) -> None:
    """Kill a recovering child at each of ``RECOVERY_KILLS``; the next recovery must finish the job."""
    url = server_url(request, db_kind) or f"sqlite:///{tmp_path / 'r.db'}"
    engine = prepare_db(url)
    series = f"recovery-kill-{db_kind}-{uuid.uuid4().hex[:6]}"
    tid, topic = f"dw-{series}", create_topic(kafka_bootstrap)
    results = tmp_path / "results.jsonl"
    acks = AckLog(tmp_path / f"{series}.acks")
    base = {"db_url": url, "bootstrap": kafka_bootstrap, "tid": tid, "topic": topic, "series": series,
            "results": str(results), "ack_log": str(acks.path), "transactions": 2, "records": 2}
    run = 0
    killed_recoveries = []
    for kill, allowed in RECOVERY_KILLS:
        # A child leaves a transaction the database committed and Kafka has only prepared...
        assert zygote.run({**base, "run": run, "point": "db_committed", "crash_txn": 1}) == -9
        # ...then a recovering child is killed during the recovery...
        assert zygote.run({**base, "run": run + 1, "recover_only": True, "hang_after": True, **kill}) == -9
        killed_recoveries.append((run + 1, allowed))
        run += 2
    # ...and the next recovery finishes the job.
    final = getattr(zygote, "final_recovery", recover_here)(engine, kafka_bootstrap, tid)
    seen = {r["run"]: r for r in map(json.loads, results.read_text().splitlines())}
    decisions = {run: seen.get(run + 1, {}).get("decision") for run, _ in killed_recoveries}
    decisions[killed_recoveries[-1][0]] = final["decision"]
    print(f"\nrecovery killed ({db_kind}) -> next recovery decided:",
          [(kill, decisions[r]) for (kill, _), (r, _) in zip(RECOVERY_KILLS, killed_recoveries)])
    for killed_run, allowed in killed_recoveries:
        assert decisions[killed_run] in allowed, (killed_run, decisions[killed_run], allowed)
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, series, acks)
    assert not problems, problems
    assert rows == records == len(RECOVERY_KILLS) * 4  # two transactions of two records per worker
    assert len(acks.ids()) == len(RECOVERY_KILLS) * 2  # each worker's first transaction was acknowledged
    assert_nothing_open(kafka_bootstrap, [tid], prefix=f"{tid}-", topics=[topic])  # Kafka's own tool agrees (a pool: <tid>-n)
    engine.dispose()
