"""The Django app's crash matrix, on the shared harness: SIGKILL at every step, then ``recover()``; zombies.

:mod:`harness.crash_matrix` runs its series with :class:`harness.django_crash.DjangoZygote` children:
each child is a Django process that recovers at its start (``recover()``) and writes with
``dual_write()``; the kill points, the expected database outcomes and recovery decisions, and the end
checks (rows == ``read_committed`` records, nothing left hanging) are the SQLAlchemy matrix's.  On top:
every write a child acknowledged (its block returned) is kept, and Apache Kafka's own
``TransactionsCommand`` finds no transaction of the series' ids left open.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.acks import AckLog, assert_acknowledged
from harness.crash_matrix import (
    PARALLEL,
    PIPELINED_EXPECTED,
    check_reports,
    crash_points,
    db_url_for,
    prepare_db,
    print_reports,
    run_matrix,
    run_recovery_kills,
    server_url,
)
from harness.django_crash import DjangoZygote
from harness.dw_crash import check_consistency

from kafka2pc.testing import create_topic, drain


@pytest.fixture
def zygotes(tmp_path: Path) -> Iterator[list[DjangoZygote]]:
    procs = [DjangoZygote(tmp_path / f"zygote-{i}.log") for i in range(PARALLEL)]
    yield procs
    for z in procs:
        z.close()


#: The pipelined pool's kill points in CI: after the database COMMIT, where its path differs (up to the
#: ``db_committed`` step a pipelined block runs the serial code), plus ``responded``.  The campaign, and
#: ``$KAFKA2PC_CRASH_POINTS``, run every point.
PIPELINED_CI_POINTS = ["db_committed", "kafka_committed", *PIPELINED_EXPECTED]
#: The serial pool's kill points in CI on SQLite and MariaDB: the decisions around the database COMMIT, where
#: the database's own behaviour decides (the SQLAlchemy matrix runs every point on each database; this one on
#: PostgreSQL).  The campaign, and ``$KAFKA2PC_CRASH_POINTS``, run every point.
OTHER_DATABASE_CI_POINTS = ["prepared", "state_stored", "db_committing", "db_committed"]


@pytest.mark.slow
@pytest.mark.parametrize(("db_kind", "pipelined"), [
    pytest.param("postgresql", False, id="postgresql"),
    pytest.param("sqlite", False, id="sqlite"),
    pytest.param("mariadb", False, id="mariadb"),
    pytest.param("sqlite", False, id="sqlite-every-point", marks=pytest.mark.campaign),
    pytest.param("mariadb", False, id="mariadb-every-point", marks=pytest.mark.campaign),
    pytest.param("postgresql", True, id="postgresql-pipelined"),
    pytest.param("sqlite", True, id="sqlite-pipelined", marks=pytest.mark.campaign),
    pytest.param("mariadb", True, id="mariadb-pipelined", marks=pytest.mark.campaign),
])
def test_django_crash_matrix(db_kind: str, pipelined: bool, request: pytest.FixtureRequest, kafka_bootstrap: str,
                             zygotes: list[DjangoZygote], tmp_path: Path, seed: int) -> None:
    """SIGKILL at every step, then recovery; pipelined (``POOL_OPTIONS["pipelined"]``), also right after the
    response, with the block's Kafka commit still in flight (``responded``)."""
    server = server_url(request, db_kind)
    points = crash_points()
    whole = request.node.get_closest_marker("campaign") is not None or os.environ.get("KAFKA2PC_CRASH_POINTS")
    if pipelined:
        points = (points if whole else [p for p in points if p in PIPELINED_CI_POINTS]) + list(PIPELINED_EXPECTED)
    elif db_kind != "postgresql" and not whole:
        points = [p for p in points if p in OTHER_DATABASE_CI_POINTS]
    started = time.monotonic()
    reports = run_matrix(db_kind, points, list(zygotes), lambda p: db_url_for(db_kind, server, tmp_path, p),
                         kafka_bootstrap, tmp_path, seed, {"pipelined": True} if pipelined else None)
    print_reports(reports)
    print(f"{db_kind}: {sum(r.runs for r in reports)} Django children in {time.monotonic() - started:.0f} s")
    failures = [f"{r.point}/{r.db}: {f}" for r in reports for f in r.failures]
    assert not failures, "\n".join(failures)
    # The SQLAlchemy matrix's checks: every acknowledged write kept (id by id, in the database and once in
    # read_committed), the expected decisions, and Kafka's own TransactionsCommand finding nothing open.
    check_reports(reports, kafka_bootstrap, tid_is_prefix=True)
    assert sum(r.acknowledged for r in reports) > 0


@pytest.mark.parametrize("db_kind", ["postgresql", "sqlite", "mariadb"])
def test_django_kill_during_recovery_then_recover_again(
    db_kind: str, request: pytest.FixtureRequest, kafka_bootstrap: str, tmp_path: Path
) -> None:
    zygote = DjangoZygote(tmp_path / "zygote.log")
    try:
        run_recovery_kills(db_kind, request, kafka_bootstrap, zygote, tmp_path)
    finally:
        zygote.close()


def test_django_zombie_is_fenced_and_changes_nothing(pg_url: str, kafka_bootstrap: str, tmp_path: Path) -> None:
    """A worker SIGSTOPped in its block, taken over by a survivor, then resumed: fenced, nothing kept."""
    engine = prepare_db(pg_url)
    series = f"zombie-{uuid.uuid4().hex[:6]}"
    prefix, topic = f"dj-{series}", create_topic(kafka_bootstrap)
    results, marker = tmp_path / "results.jsonl", tmp_path / "marker.jsonl"
    base = {"db_url": pg_url, "bootstrap": kafka_bootstrap, "tid": prefix, "topic": topic, "series": series,
            "results": str(results), "transactions": 2, "records": 2, "lease_s": 2.0}
    zombie_z, survivor_z = DjangoZygote(tmp_path / "z1.log"), DjangoZygote(tmp_path / "z2.log")
    exits: list[int] = []
    try:
        # The zombie commits its first transaction, then stops (SIGSTOP) inside the second one's block.
        zombie = threading.Thread(target=lambda: exits.append(zombie_z.run(
            {**base, "run": 0, "role": "zombie", "crash_txn": 1, "stop_at": "produced", "marker": str(marker),
             "record_errors": True}, timeout=180)))
        zombie.start()
        deadline = time.monotonic() + 60
        while not marker.exists() or not marker.read_text().strip():
            assert time.monotonic() < deadline and zombie.is_alive(), "the zombie never stopped"
            time.sleep(0.05)
        pid = json.loads(marker.read_text().splitlines()[0])["pid"]
        # A survivor settles the zombie's id once its lease expired (the zombie renews no more) and writes.
        assert survivor_z.run({**base, "run": 1, "role": "survivor", "record_errors": True}) == 0
        os.kill(pid, signal.SIGCONT)
        zombie.join(120)
        assert exits == [0]
    finally:
        if "pid" in locals():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        zombie_z.close()
        survivor_z.close()
    outcome = {(r.get("role"), "error" in r): r for r in map(json.loads, results.read_text().splitlines())}
    assert outcome[("survivor", True)]["error"] is None
    error = outcome[("zombie", True)]["error"]
    assert error in ("ProducerFencedError",), outcome[("zombie", True)]
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, series)
    assert not problems
    assert rows == records == 2 + 4  # the zombie's first transaction and the survivor's two; its second: nothing
    ids = sorted(r.value.decode() for r in drain(kafka_bootstrap, topic, "read_committed") if r.value)
    assert not [i for i in ids if i.startswith(f"{series}:0-1-")]
    assert_acknowledged(AckLog(str(results) + ".acks"), ids, ids)
    engine.dispose()


def test_django_survivor_settles_a_killed_workers_transaction_within_the_lease(
    pg_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A worker killed after its database COMMIT, before its Kafka commit; a live worker settles it alone.

    No one calls recover() after the kill: the survivor's pool finds the expired lease in its orphan scan
    and commits the prepared transaction, within ``lease_s`` + ``scan_every_s`` (+ the recovery).
    """
    lease_s = 2.0
    bound_s = lease_s + lease_s / 3 * 1.2 + 10.0  # lease, one scan interval (jittered), the recovery on a loaded machine
    engine = prepare_db(pg_url)
    series = f"survivor-{uuid.uuid4().hex[:6]}"
    topic = create_topic(kafka_bootstrap)
    base = {"db_url": pg_url, "bootstrap": kafka_bootstrap, "tid": f"dj-{series}", "topic": topic, "series": series,
            "results": str(tmp_path / "results.jsonl"), "transactions": 1, "records": 2, "lease_s": lease_s}
    victim_z, survivor_z = DjangoZygote(tmp_path / "z1.log"), DjangoZygote(tmp_path / "z2.log")
    exits: list[int] = []
    try:
        assert victim_z.run({**base, "run": 0, "point": "db_committed", "crash_txn": 0}) == -9
        killed_at = time.monotonic()
        survivor = threading.Thread(target=lambda: exits.append(survivor_z.run({**base, "run": 1, "survive_s": bound_s})))
        survivor.start()
        wanted = {f"{series}:0-0-0", f"{series}:0-0-1"}
        while not wanted <= {r.value.decode() for r in drain(kafka_bootstrap, topic, "read_committed") if r.value}:
            assert time.monotonic() - killed_at < bound_s, "the survivor did not settle the killed worker's transaction"
            time.sleep(0.2)
        settled_s = time.monotonic() - killed_at
        survivor.join(60)
        assert exits == [0]
    finally:
        victim_z.close()
        survivor_z.close()
    print(f"\nthe survivor settled the killed worker's transaction {settled_s:.1f} s after the kill (bound {bound_s:.1f} s)")
    assert settled_s <= bound_s
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, series)
    assert not problems and rows == records == 2
    engine.dispose()
