"""Takeovers of a live writer: writer A stopped (SIGSTOP) at every step, writer B recovering the same id.

For each (writer step x recovery step x database x retain_records x what
happens to A) a series of runs under one transactional id:

1. A (a child process) recovers, commits two transactions, and stops itself
   with SIGSTOP at the chosen step of its third;
2. B (another child) recovers the same id and is killed with SIGKILL at the
   chosen recovery step, or recovers to the end ("done");
3. A is continued (SIGCONT) and finishes its transaction, or is killed (SIGKILL).

Every run must reach the step its cell names: B dies by SIGKILL at its
recovery step, or (``done``) exits having recovered, with the decision A's
step implies (``B_DECISIONS``). Where it cannot, the cell says so up front:
A holds the state row's lock from the start of its transaction on SQLite and
MySQL/MariaDB, and from its state update to its COMMIT on PostgreSQL with an
ORM ``Session``, and with ``retain_records`` A holds the outbox rows it
deletes first, which a B recovering to the end waits on after settling Kafka
(``locked_out``); there B must fail with ``StateRowLockedError`` (nothing
changed), and the test prints those runs and why. Any other exit of B, or of A (0 when continued, SIGKILL when
killed), fails the test. Checked too: the error A sees is ``None`` (it
committed) or ``ProducerFencedError`` (the one documented error of a
taken-over writer), and after a final recovery I1-I5 hold: every committed
row has exactly one ``read_committed`` record and vice versa (nothing lost,
nothing duplicated, nothing of a rolled-back transaction visible), every
transaction A acknowledged (its block returned: ``harness.acks``) is among
them, and nothing is left hanging (``read_committed`` end offset ==
``read_uncommitted`` end offset).

``KAFKA2PC_TAKEOVER_RUNS`` (default 10) runs per cell in the full matrix
(marker ``campaign``; ``KAFKA2PC_TAKEOVER_STEPS`` narrows the writer steps).
Always run: a sample with one run of every (writer step x recovery step)
cell on PostgreSQL, where B can reach every recovery step, with
``retain_records`` and A's fate drawn from the test's seed
(``$KAFKA2PC_SEED``, ``harness.seeds``) so that every combination of those
occurs; one locked-out cell per writer step on SQLite or MariaDB (drawn the
same way); and the bounded test (A stopped after its prepare, B killed after
settling Kafka, with and without ``retain_records``, on PostgreSQL),
``KAFKA2PC_TAKEOVER_BOUNDED_RUNS`` (default 3) runs per cell.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from harness.acks import AckLog
from harness.crash_matrix import prepare_db, server_url
from harness.dw_crash import Zygote, check_consistency
from harness.kafka_judge import assert_nothing_open
from kafka2pc.recipes.dual_write import DualWriter, define_outbox_table, define_state_table

from kafka2pc.testing import create_topic

RUNS = int(os.environ.get("KAFKA2PC_TAKEOVER_RUNS", "10"))
BOUNDED_RUNS = int(os.environ.get("KAFKA2PC_TAKEOVER_BOUNDED_RUNS", "3"))
PAIRS = int(os.environ.get("KAFKA2PC_TAKEOVER_PARALLEL", "2"))
DATABASES = ["postgresql", "sqlite", "mariadb"]
ROW_LOCK_DATABASES = ["sqlite", "mariadb"]

WRITER_STEPS = ["db_begun", "kafka_begun", "produced", "body_done", "prepared", "state_stored",
                "db_committing", "db_committed"]
RECOVERY_STEPS = ["recovery_locked", "recovery_claimed", "recovery_settled", "done"]
#: The recovery step of a cell whose B cannot get past its claim (see ``locked_out``).
LOCKED_OUT = "locked_out"
ALLOWED_A_ERRORS = {None, "ProducerFencedError"}
#: A's writer step -> the decisions B's recovery to the end ("done") may take: A's third transaction is
#: open (or not begun at Kafka), prepared or committed by the database; its state is stored with the COMMIT
#: (a Connection on PostgreSQL: one round trip) or before it (a Session), never committed before db_committed.
B_DECISIONS: dict[str, frozenset[str]] = {
    "db_begun": frozenset({"nothing"}),
    "kafka_begun": frozenset({"nothing"}),
    "produced": frozenset({"nothing", "abort"}),
    "body_done": frozenset({"nothing", "abort"}),
    "prepared": frozenset({"abort"}),
    "state_stored": frozenset({"abort"}),
    "db_committing": frozenset({"abort"}),
    "db_committed": frozenset({"commit"}),
}


def uses_session(run: int) -> bool:
    """Whether A's run ``run`` writes through an ORM Session (odd runs; ``harness.dw_crash``'s rule)."""
    return run % 2 == 1


def locked_out(cell: Cell, run: int) -> str | None:
    """Why B cannot reach ``cell``'s recovery step in ``run`` (A, stopped, holds a lock B needs), or None.

    SQLite and MySQL/MariaDB: the writer locks the state row when its transaction starts (before
    ``db_begun``) until its COMMIT, so B's claim fails. PostgreSQL: a Session's state update locks the row
    (``state_stored`` on) until the COMMIT; a Connection sends the update with the COMMIT, so B's claim
    never waits on it. With ``retain_records`` A's transaction starts by deleting the outbox rows its last
    one left, so a B that recovers to the end waits on them at its last step, after settling Kafka.
    """
    if cell.writer_step == "db_committed":
        return None  # A committed its database transaction: it holds nothing
    if cell.db in ROW_LOCK_DATABASES:
        return f"{cell.db}: A holds the state row from the start of its transaction"
    if uses_session(run) and cell.writer_step in ("state_stored", "db_committing"):
        return "postgresql: A's Session holds the state row from its state update"
    if cell.retain and cell.recovery_step == "done":
        return "retain_records: A holds the outbox rows it deletes first; B's last step waits on them"
    return None


@dataclass
class Cell:
    db: str
    writer_step: str
    recovery_step: str
    retain: bool
    a_fate: str  # "cont" (SIGCONT) or "kill" (SIGKILL)
    target_runs: int = RUNS
    runs: int = 0
    a_errors: Counter[str] = field(default_factory=Counter)
    b_outcomes: Counter[str] = field(default_factory=Counter)
    rows: int = 0
    records: int = 0
    acknowledged: int = 0
    tid: str = ""
    topic: str = ""
    locked_out: Counter[str] = field(default_factory=Counter)
    """Runs whose B could not reach the recovery step, by reason (see ``locked_out``)."""
    failures: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.db}/{self.writer_step}x{self.recovery_step}/{'retain' if self.retain else 'plain'}/{self.a_fate}"


def _wait_marker(marker: Path, run: int, timeout: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marker.exists():
            for line in marker.read_text().splitlines():
                entry = json.loads(line)
                if entry["run"] == run:
                    return dict(entry)
        time.sleep(0.02)
    return None


def run_cell(cell: Cell, a_zygote: Zygote, b_zygote: Zygote, url: str, bootstrap: str, workdir: Path) -> Cell:
    series = f"to-{uuid.uuid4().hex[:8]}"
    tid, topic = f"dw-{series}", create_topic(bootstrap)
    cell.tid, cell.topic = tid, topic
    results, marker = workdir / f"{series}.jsonl", workdir / f"{series}.marker"
    acks = AckLog(workdir / f"{series}.acks")
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    base = {"db_url": url, "bootstrap": bootstrap, "tid": tid, "topic": topic, "series": series,
            "results": str(results), "ack_log": str(acks.path), "retain": cell.retain, "record_errors": True,
            "sqlite_timeout": 1.0}
    try:
        for run in range(cell.target_runs):
            a_job = {**base, "run": run, "role": "A", "transactions": 3, "records": 2, "crash_txn": 2,
                     "stop_at": cell.writer_step, "marker": str(marker), "session": uses_session(run)}
            a_exit: list[int] = []
            a_thread = threading.Thread(target=lambda: a_exit.append(a_zygote.run(a_job, timeout=180)))
            a_thread.start()
            stopped = _wait_marker(marker, run, 60)
            if stopped is None:
                a_thread.join(60)
                cell.failures.append(f"run {run}: A never stopped at {cell.writer_step} (exit {a_exit})")
                break
            why = locked_out(cell, run)
            expected = LOCKED_OUT if why else cell.recovery_step
            if why:
                cell.locked_out[why] += 1
            elif cell.recovery_step == LOCKED_OUT:
                cell.failures.append(f"run {run}: a locked-out cell whose B meets no lock")
            b_job = {**base, "run": run, "role": "B", "recover_only": True, "lock_timeout_s": 2.0}
            if cell.recovery_step not in ("done", LOCKED_OUT):
                b_job["recovery_point"] = cell.recovery_step
            b_exit = b_zygote.run(b_job, timeout=120)
            b_entry = _entry(results, run, "B")
            outcome = _b_outcome(b_exit, b_entry)
            cell.b_outcomes[outcome] += 1
            cell.failures.extend(f"run {run}: {problem}" for problem in _b_problems(cell, expected, outcome, b_entry))
            os.kill(stopped["pid"], signal.SIGCONT if cell.a_fate == "cont" else signal.SIGKILL)
            a_thread.join(180)
            if not a_exit:
                cell.failures.append(f"run {run}: A did not finish")
                break
            if a_exit[0] != (0 if cell.a_fate == "cont" else -signal.SIGKILL):
                cell.failures.append(f"run {run}: A ({cell.a_fate}) exited {a_exit[0]}")
            cell.runs += 1
        seen = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
        for entry in seen:
            if entry.get("role") == "A" and "error" in entry:
                cell.a_errors[str(entry["error"])] += 1
                if entry["error"] not in ALLOWED_A_ERRORS:
                    cell.failures.append(f"run {entry['run']}: A saw {entry['error']}: {entry.get('message')}")
        final = DualWriter(engine, {"bootstrap.servers": bootstrap, "transactional.id": tid},
                           state_table=define_state_table(sa.MetaData()), outbox_table=define_outbox_table(sa.MetaData()),
                           retain_records=cell.retain)
        try:
            result = final.recover(on_heuristic="report")
            if result.heuristic and not result.republished:
                cell.failures.append("the final recovery found a heuristic outcome")
        finally:
            final.close()
        cell.rows, cell.records, problems = check_consistency(engine, bootstrap, topic, series, acks)
        cell.acknowledged = len(acks.ids())
        cell.failures.extend(problems)
        # A's first two transactions were acknowledged in every run, its third when it was continued and
        # committed (no error).
        committed_third = sum(1 for e in seen if e.get("role") == "A" and e.get("error", "") is None)
        if cell.acknowledged != 2 * 2 * cell.runs + 2 * committed_third:
            cell.failures.append(f"{cell.acknowledged} ids acknowledged in {cell.runs} runs "
                                 f"({committed_third} thirds committed)")
    finally:
        engine.dispose()
    return cell


def _entry(results: Path, run: int, role: str) -> dict[str, Any] | None:
    """The result line of ``role``'s recovery in ``run`` (written before a ``done`` B exits)."""
    if not results.exists():
        return None
    for line in results.read_text().splitlines():
        entry = json.loads(line)
        if entry.get("run") == run and entry.get("role") == role and ("decision" in entry or "recover_error" in entry):
            return dict(entry)
    return None


def _b_outcome(b_exit: int, entry: dict[str, Any] | None) -> str:
    if b_exit == -signal.SIGKILL:
        return "killed"
    if b_exit != 0:
        return f"exit {b_exit}"
    if entry is not None and "recover_error" in entry:
        return "locked out" if entry["recover_error"] == "StateRowLockedError" else entry["recover_error"]
    return "recovered" if entry is not None else "exited without a result"


def _b_problems(cell: Cell, expected: str, outcome: str, entry: dict[str, Any] | None) -> list[str]:
    """Why B's run did not end as ``expected`` (its cell's recovery step, or ``LOCKED_OUT``)."""
    if expected == LOCKED_OUT:
        want = "locked out"
    elif expected == "done":
        want = "recovered"
    else:
        want = "killed"
    if outcome != want:
        return [f"B ended {outcome!r}, not {want!r} (expected to reach {expected})"]
    if want == "recovered" and entry is not None and entry.get("decision") not in B_DECISIONS[cell.writer_step]:
        return [f"B decided {entry.get('decision')!r} with A stopped at {cell.writer_step}; "
                f"expected one of {sorted(B_DECISIONS[cell.writer_step])}"]
    return []


def _zygote_pairs(tmp_path: Path, n: int) -> Iterator[list[tuple[Zygote, Zygote]]]:
    pairs = [(Zygote(tmp_path / f"a-{i}.log"), Zygote(tmp_path / f"b-{i}.log")) for i in range(n)]
    yield pairs
    for a, b in pairs:
        a.close()
        b.close()


@pytest.fixture
def zygote_pairs(tmp_path: Path) -> Iterator[list[tuple[Zygote, Zygote]]]:
    yield from _zygote_pairs(tmp_path, PAIRS)


@pytest.fixture
def sample_pairs(tmp_path: Path) -> Iterator[list[tuple[Zygote, Zygote]]]:
    """Twice as many pairs for the sample: its runs mostly wait (a stopped writer, a locked state row)."""
    yield from _zygote_pairs(tmp_path, 2 * PAIRS)


def _url(servers: dict[str, str], tmp_path: Path, cell: Cell) -> str:
    if cell.db != "sqlite":
        return servers[cell.db]  # the server database's URL (PostgreSQL or MariaDB)
    return f"sqlite:///{tmp_path / (cell.name.replace('/', '_') + '.db')}"


def _run(
    cells: list[Cell], pairs: list[tuple[Zygote, Zygote]], servers: dict[str, str], bootstrap: str, tmp_path: Path
) -> None:
    free = list(pairs)
    lock = threading.Lock()
    for url in {_url(servers, tmp_path, c) for c in cells}:
        prepare_db(url).dispose()  # before the threads: concurrent CREATE TABLEs of one database collide

    def one(cell: Cell) -> Cell:
        with lock:
            pair = free.pop()
        try:
            url = _url(servers, tmp_path, cell)
            return run_cell(cell, pair[0], pair[1], url, bootstrap, tmp_path)
        finally:
            with lock:
                free.append(pair)

    with ThreadPoolExecutor(len(pairs)) as pool:
        list(pool.map(one, cells))
    print(f"\n{'cell':<62}{'runs':>5}  A errors / B outcomes  rows=records  acked")
    for c in cells:
        print(f"{c.name:<62}{c.runs:>5}  {dict(c.a_errors)} / {dict(c.b_outcomes)}  {c.rows}={c.records}  "
              f"{c.acknowledged}")
    reasons: dict[str, list[str]] = {}
    for c in cells:
        for why, n in c.locked_out.items():
            reasons.setdefault(why, []).append(f"{c.name} x{n}")
    for why, names in reasons.items():
        print(f"B could not reach its recovery step, and failed with StateRowLockedError as it must ({why}): "
              f"{', '.join(names)}")
    failures = [f"{c.name}: {f}" for c in cells for f in c.failures]
    assert not failures, "\n".join(failures)
    for c in cells:
        assert c.runs == c.target_runs, c.name
        assert c.rows == c.records
    assert_nothing_open(bootstrap, [c.tid for c in cells], topics=[c.topic for c in cells])  # Kafka's own tool agrees


def _cells(db: str, writer_steps: list[str], recovery_steps: list[str]) -> list[Cell]:
    return [Cell(db, w, r, retain, fate) for w in writer_steps for r in recovery_steps
            for retain in (False, True) for fate in ("cont", "kill")]


def test_takeover_of_a_stopped_writer_bounded(
    request: pytest.FixtureRequest, kafka_bootstrap: str, zygote_pairs: list[tuple[Zygote, Zygote]],
    tmp_path: Path,
) -> None:
    """The cells of issue 11's first bug (A stopped after its prepare, B killed after settling Kafka).

    On PostgreSQL, the one database where A stopped after its prepare leaves B the state row: on SQLite
    and MariaDB A holds it from its start (the sample's locked-out cells run those).
    """
    cells = [Cell("postgresql", "prepared", "recovery_settled", retain, "cont", BOUNDED_RUNS) for retain in (False, True)]
    _run(cells, zygote_pairs, {"postgresql": server_url(request, "postgresql")}, kafka_bootstrap, tmp_path)


def sample_cells(seed: int) -> list[Cell]:
    """The sample: every (writer step x recovery step) cell on PostgreSQL, and a locked-out cell per writer step.

    On PostgreSQL (one run each: a Connection, which never makes B wait) B reaches every recovery step;
    ``retain_records`` and A's fate go round their four combinations in an order drawn from ``seed``
    (without ``retain_records`` where B recovers to the end: see ``locked_out``). On
    SQLite and MariaDB A holds the state row from its start, so B's claim fails (``LOCKED_OUT``): one cell
    per writer step, its database, ``retain_records`` and fate drawn so that each of their eight
    combinations occurs once.
    """
    rng = random.Random(seed)
    pairs = [(w, r) for w in WRITER_STEPS for r in RECOVERY_STEPS if r != "done"]
    variants = [(retain, fate) for retain in (False, True) for fate in ("cont", "kill")]
    rng.shuffle(pairs)
    rng.shuffle(variants)
    cells = [Cell("postgresql", w, r, retain, fate, 1)
             for (w, r), (retain, fate) in zip(pairs, itertools.cycle(variants))]
    # B recovering to the end waits on the outbox rows A (retain_records) holds: "done" cells are plain.
    cells += [Cell("postgresql", w, "done", False, rng.choice(["cont", "kill"]), 1) for w in WRITER_STEPS]
    locked = [(db, retain, fate) for db in ROW_LOCK_DATABASES for retain in (False, True) for fate in ("cont", "kill")]
    rng.shuffle(locked)
    steps = [w for w in WRITER_STEPS if w != "db_committed"]  # at db_committed A committed: nothing is locked
    cells += [Cell(db, w, LOCKED_OUT, retain, fate, 1)
              for w, (db, retain, fate) in zip(steps, itertools.cycle(locked))]
    return cells


def test_sample_of_every_takeover_cell(
    request: pytest.FixtureRequest, kafka_bootstrap: str, sample_pairs: list[tuple[Zygote, Zygote]], tmp_path: Path,
    seed: int,
) -> None:
    """The campaign's cells, one run each, drawn from the test's seed (``$KAFKA2PC_SEED``)."""
    cells = sample_cells(seed)
    pg = [c for c in cells if c.db == "postgresql"]
    assert {(c.writer_step, c.recovery_step) for c in pg} == {(w, r) for w in WRITER_STEPS for r in RECOVERY_STEPS}
    assert len({(c.retain, c.a_fate) for c in pg}) == 4
    locked = [c for c in cells if c.recovery_step == LOCKED_OUT]
    assert len({(c.db, c.retain, c.a_fate) for c in locked}) == len(locked) == 2 * 2 * len(ROW_LOCK_DATABASES) - 1
    servers = {db: server_url(request, db) for db in DATABASES if db != "sqlite"}
    _run(cells, sample_pairs, servers, kafka_bootstrap, tmp_path)


@pytest.mark.slow
@pytest.mark.campaign
@pytest.mark.timeout(4 * 3600)  # 64 cells x RUNS runs; the ini's 15 minutes bound ordinary tests
@pytest.mark.parametrize("retain", [False, True], ids=["plain", "retain"])
@pytest.mark.parametrize("db", DATABASES)
def test_takeover_matrix(
    db: str, retain: bool, request: pytest.FixtureRequest, kafka_bootstrap: str,
    zygote_pairs: list[tuple[Zygote, Zygote]], tmp_path: Path,
) -> None:
    """Every (writer step x recovery step x SIGCONT/SIGKILL) cell, RUNS runs each."""
    steps = os.environ.get("KAFKA2PC_TAKEOVER_STEPS")
    writer_steps = steps.split(",") if steps else WRITER_STEPS
    recovery = os.environ.get("KAFKA2PC_TAKEOVER_RECOVERY_STEPS")
    cells = [c for c in _cells(db, writer_steps, recovery.split(",") if recovery else RECOVERY_STEPS)
             if c.retain is retain]
    _run(cells, zygote_pairs, {db: server_url(request, db)}, kafka_bootstrap, tmp_path)
