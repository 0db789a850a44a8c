"""Takeovers of a live writer: writer A stopped (SIGSTOP) at every step, writer B recovering the same id.

For each (writer step x recovery step x database x retain_records x what
happens to A) a series of runs under one transactional id:

1. A (a child process) recovers, commits two transactions, and stops itself
   with SIGSTOP at the chosen step of its third;
2. B (another child) recovers the same id and is killed with SIGKILL at the
   chosen recovery step, or recovers to the end ("done"); on SQLite, and on
   PostgreSQL while A holds the row lock, B may find the state row locked
   (typed ``StateRowLockedError``, nothing changed);
3. A is continued (SIGCONT) and finishes its transaction, or is killed (SIGKILL).

Checked: the error A sees is ``None`` (it committed) or ``ProducerFencedError``
(the one documented error of a taken-over writer), and after a final recovery
I1-I5 hold: every committed row has exactly one ``read_committed`` record and
vice versa (nothing lost, nothing duplicated, nothing of a rolled-back
transaction visible), and nothing is left hanging (``read_committed`` end
offset == ``read_uncommitted`` end offset).

``KAFKA2PC_TAKEOVER_RUNS`` (default 10) runs per cell in the full matrix
(marker ``campaign``; ``KAFKA2PC_TAKEOVER_STEPS`` narrows the writer steps).
Always run: a sample with one run of every (writer step x recovery step)
cell, its database, ``retain_records`` and A's fate drawn with
``KAFKA2PC_TAKEOVER_SEED`` so that every combination of those occurs; and
the bounded test (A stopped after its prepare, B killed after settling
Kafka, with and without ``retain_records``),
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
from harness.crash_matrix import prepare_db, server_url
from harness.dw_crash import Zygote, check_consistency
from kafka2pc.recipes.dual_write import DualWriter, define_outbox_table, define_state_table

from kafka2pc.testing import create_topic

RUNS = int(os.environ.get("KAFKA2PC_TAKEOVER_RUNS", "10"))
BOUNDED_RUNS = int(os.environ.get("KAFKA2PC_TAKEOVER_BOUNDED_RUNS", "3"))
PAIRS = int(os.environ.get("KAFKA2PC_TAKEOVER_PARALLEL", "2"))
SAMPLE_SEED = int(os.environ.get("KAFKA2PC_TAKEOVER_SEED", "939"))
DATABASES = ["postgresql", "sqlite", "mariadb"]

WRITER_STEPS = ["db_begun", "kafka_begun", "produced", "body_done", "prepared", "state_stored",
                "db_committing", "db_committed"]
RECOVERY_STEPS = ["recovery_locked", "recovery_claimed", "recovery_settled", "done"]
ALLOWED_A_ERRORS = {None, "ProducerFencedError"}


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
    results, marker = workdir / f"{series}.jsonl", workdir / f"{series}.marker"
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    base = {"db_url": url, "bootstrap": bootstrap, "tid": tid, "topic": topic, "series": series,
            "results": str(results), "retain": cell.retain, "record_errors": True, "sqlite_timeout": 1.0}
    try:
        for run in range(cell.target_runs):
            a_job = {**base, "run": run, "role": "A", "transactions": 3, "records": 2, "crash_txn": 2,
                     "stop_at": cell.writer_step, "marker": str(marker)}
            a_exit: list[int] = []
            a_thread = threading.Thread(target=lambda: a_exit.append(a_zygote.run(a_job, timeout=180)))
            a_thread.start()
            stopped = _wait_marker(marker, run, 60)
            if stopped is None:
                a_thread.join(60)
                cell.failures.append(f"run {run}: A never stopped at {cell.writer_step} (exit {a_exit})")
                break
            b_job = {**base, "run": run, "role": "B", "recover_only": True, "lock_timeout_s": 2.0}
            if cell.recovery_step != "done":
                b_job["recovery_point"] = cell.recovery_step
            b_exit = b_zygote.run(b_job, timeout=120)
            cell.b_outcomes["killed" if b_exit == -9 else "exited" if b_exit == 0 else f"exit {b_exit}"] += 1
            os.kill(stopped["pid"], signal.SIGCONT if cell.a_fate == "cont" else signal.SIGKILL)
            a_thread.join(180)
            if not a_exit:
                cell.failures.append(f"run {run}: A did not finish")
                break
            cell.runs += 1
        seen = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
        for entry in seen:
            if entry.get("role") == "A" and "error" in entry:
                cell.a_errors[str(entry["error"])] += 1
                if entry["error"] not in ALLOWED_A_ERRORS:
                    cell.failures.append(f"run {entry['run']}: A saw {entry['error']}: {entry.get('message')}")
            if entry.get("role") == "B" and "recover_error" in entry:
                cell.b_outcomes[entry["recover_error"]] += 1
                if entry["recover_error"] != "StateRowLockedError":
                    cell.failures.append(f"run {entry['run']}: B's recovery raised {entry['recover_error']}")
        final = DualWriter(engine, {"bootstrap.servers": bootstrap, "transactional.id": tid},
                           state_table=define_state_table(sa.MetaData()), outbox_table=define_outbox_table(sa.MetaData()),
                           retain_records=cell.retain)
        try:
            result = final.recover(on_heuristic="report")
            if result.heuristic and not result.republished:
                cell.failures.append("the final recovery found a heuristic outcome")
        finally:
            final.close()
        cell.rows, cell.records, problems = check_consistency(engine, bootstrap, topic, series)
        cell.failures.extend(problems)
    finally:
        engine.dispose()
    return cell


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
    print(f"\n{'cell':<62}{'runs':>5}  A errors / B outcomes  rows=records")
    for c in cells:
        print(f"{c.name:<62}{c.runs:>5}  {dict(c.a_errors)} / {dict(c.b_outcomes)}  {c.rows}={c.records}")
    failures = [f"{c.name}: {f}" for c in cells for f in c.failures]
    assert not failures, "\n".join(failures)
    for c in cells:
        assert c.runs == c.target_runs, c.name
        assert c.rows == c.records


def _cells(db: str, writer_steps: list[str], recovery_steps: list[str]) -> list[Cell]:
    return [Cell(db, w, r, retain, fate) for w in writer_steps for r in recovery_steps
            for retain in (False, True) for fate in ("cont", "kill")]


@pytest.mark.parametrize("db", DATABASES)
def test_takeover_of_a_stopped_writer_bounded(
    db: str, request: pytest.FixtureRequest, kafka_bootstrap: str, zygote_pairs: list[tuple[Zygote, Zygote]],
    tmp_path: Path,
) -> None:
    """The cells of issue 11's first bug (A stopped after its prepare, B killed after settling Kafka)."""
    cells = [Cell(db, "prepared", "recovery_settled", retain, "cont", BOUNDED_RUNS) for retain in (False, True)]
    _run(cells, zygote_pairs, {db: server_url(request, db)}, kafka_bootstrap, tmp_path)


def sample_cells(seed: int) -> list[Cell]:
    """One run of every (writer step x recovery step) cell; database, retain and A's fate drawn from ``seed``.

    The draws go round every (database x retain x fate) combination, so each
    of them occurs too (32 cells over 12 combinations).
    """
    rng = random.Random(seed)
    pairs = [(w, r) for w in WRITER_STEPS for r in RECOVERY_STEPS]
    variants = [(db, retain, fate) for db in DATABASES for retain in (False, True) for fate in ("cont", "kill")]
    rng.shuffle(pairs)
    rng.shuffle(variants)
    return [Cell(db, w, r, retain, fate, 1) for (w, r), (db, retain, fate) in zip(pairs, itertools.cycle(variants))]


def test_sample_of_every_takeover_cell(
    request: pytest.FixtureRequest, kafka_bootstrap: str, sample_pairs: list[tuple[Zygote, Zygote]], tmp_path: Path,
) -> None:
    """The campaign's cells, one run each (seeded by ``KAFKA2PC_TAKEOVER_SEED``)."""
    cells = sample_cells(SAMPLE_SEED)
    print(f"\ntakeover sample, KAFKA2PC_TAKEOVER_SEED={SAMPLE_SEED}")
    assert {(c.writer_step, c.recovery_step) for c in cells} == {(w, r) for w in WRITER_STEPS for r in RECOVERY_STEPS}
    assert len({(c.db, c.retain, c.a_fate) for c in cells}) == 2 * 2 * len(DATABASES)
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
