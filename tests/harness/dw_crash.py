"""Crash-test worker for the dual-write recipe: a zygote that forks one short-lived child per run.

Why a zygote: a crash matrix needs hundreds of processes, and starting
Python plus importing SQLAlchemy, confluent-kafka and kafka-python costs
~0.6 s each.  The zygote imports them once, single-threaded (no librdkafka or
kafka-python thread exists in it, so ``fork`` is safe), then forks a fresh
child per job.  Each child is a real process: it recovers, runs its
transactions through :class:`DualWriter` and kills itself with SIGKILL at the
chosen :class:`Step` (``on_step`` hook); the zygote reports how it died.

Protocol (JSON lines): the parent writes a job to the zygote's stdin and
reads ``{"pid": ..., "exit": <code or -signal>}`` back.  Children append
their observations (the recovery result) to ``job["results"]``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from harness.acks import AckLog, check_acknowledged
from harness.consumers import assign_at_committed
from harness.procs import child_env


def items_table(metadata: sa.MetaData) -> sa.Table:
    """The application table of the crash tests: one row per produced record."""
    return sa.Table(
        "dw_items",
        metadata,
        sa.Column("id", sa.String(100), primary_key=True),
        sa.Column("series", sa.String(64), nullable=False, index=True),
    )


def check_consistency(
    engine: sa.Engine, bootstrap: str, topic: str, series: str, acks: AckLog | None = None,
) -> tuple[int, int, list[str]]:
    """Rows of ``series`` vs ``read_committed`` records of ``topic``: ``(rows, records, problems)``.

    The invariant of the recipe: every committed row has exactly one visible
    record and vice versa, and no transaction is left open on the topic.
    With ``acks`` (the children's acknowledged-write log), also: every id it
    holds is a row and exactly one ``read_committed`` record (a transaction
    lost on both sides keeps ``rows == records``; this finds it).
    """
    from collections import Counter

    from kafka2pc.testing import drain, end_offsets, settled_end_offsets

    items = items_table(sa.MetaData())
    with engine.connect() as conn:
        rows = set(conn.execute(sa.select(items.c.id).where(items.c.series == series)).scalars())
    records = Counter(r.value.decode() for r in drain(bootstrap, topic, "read_committed") if r.value)
    problems = []
    duplicates = sorted(k for k, n in records.items() if n > 1)
    if duplicates:
        problems.append(f"duplicated records: {duplicates[:5]}")
    lost = sorted(rows - set(records))
    if lost:
        problems.append(f"committed rows without a record: {lost[:5]} ({len(lost)})")
    phantom = sorted(set(records) - rows)
    if phantom:
        problems.append(f"records without a committed row: {phantom[:5]} ({len(phantom)})")
    if acks is not None:
        problems.extend(check_acknowledged(acks, rows, records.elements()))
    rc, ru = settled_end_offsets(bootstrap, topic), end_offsets(bootstrap, topic, "read_uncommitted")
    if rc != ru:
        problems.append(f"transaction left hanging: read_committed end {rc} != read_uncommitted end {ru}; "
                        f"{holders(bootstrap, topic, rc, ru)}")
    return len(rows), sum(records.values()), problems


def holders(bootstrap: str, topic: str, stable: dict[int, int], high: dict[int, int]) -> str:
    """Who holds ``topic``'s last stable offsets back: the partitions' open producers and their coordinators' view."""
    from kafka2pc._control import ControlPlane
    from kafka2pc._types import TopicAndPartition as Partition

    with ControlPlane({"bootstrap.servers": bootstrap}) as ctrl:
        open_on = {
            p: [(s.producer_id, s.producer_epoch, s.current_txn_start_offset)
                for s in ctrl.describe_producers(Partition(topic, p), timeout=10) if s.current_txn_start_offset >= 0]
            for p, h in high.items() if stable.get(p, 0) < h
        }
        ids = {pid for rows in open_on.values() for pid, _, _ in rows}
        listed = [(t.transactional_id, t.producer_id, t.state) for t in ctrl.list_transactions(timeout=10)
                  if t.producer_id in ids]
        described = [ctrl.describe_transaction(tid, timeout=10) for tid, _, _ in listed]
    return f"open on the partitions (producer id, epoch, first offset): {open_on}; at the coordinator: {described}"


RACE_DELAY = (-5.0, -1.5)
"""The kill during COMMIT: 10 ** uniform(low, high) seconds after the COMMIT step (10 us to 30 ms)."""
RACE_DELAY_EARLY = (-6.0, -4.7)
"""Delays that mostly kill before the COMMIT leaves the process (1 to 20 us): the rolled-back side."""
RACE_DELAY_LATE = (-2.0, -1.3)
"""Delays that mostly kill after the database answered (10 to 50 ms): the committed side."""


def ack_log(job: dict[str, Any]) -> AckLog | None:
    """The acknowledged-write log of a crash child: ``job["ack_log"]``, else ``$KAFKA2PC_ACK_LOG``."""
    return AckLog(job["ack_log"]) if job.get("ack_log") else AckLog.from_env()


def acknowledge(log: AckLog | None, ids: list[str]) -> None:
    """Record ``ids`` (the rows and records of a transaction whose block returned) in ``log``, fsynced."""
    if log is not None:
        for rid in ids:
            log.record(rid)


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def append_record(path: str, record: dict[str, Any]) -> None:
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def session_name(pid: int) -> str:
    """The ``application_name`` of the database sessions of the PostgreSQL child with process id ``pid``.

    By process, not by job: two children of one run (a writer stopped with
    SIGSTOP and the recovery that takes over from it) must not wait on each other.
    """
    return f"k2pc-crash-{pid}"


def step_hook(job: dict[str, Any], phase: dict[str, Any]) -> Callable[[Any], None]:
    """The ``on_step`` hook of a crash child: kill (or stop) it at the job's step.

    ``phase`` is the child's progress, which it updates as it goes: ``name``
    ("recover", then "work"), ``txn`` (the index of the transaction under way).
    """
    from kafka2pc.recipes.dual_write import Step

    point = job.get("point")
    crash_txn = job.get("crash_txn", -1)
    rng = random.Random(job.get("seed", 0))

    def hook(step: Step) -> None:
        if (job.get("kill_broker_at") == step.value and not phase.get("broker_killed")
                and (phase["name"] == "recover" or phase["txn"] == crash_txn)):
            # Combined faults: this step of the child's work (or recovery) and the death of a broker (the
            # transactional id's coordinator) at once; the child goes on.
            phase["broker_killed"] = True
            os.kill(job["broker_pid"], signal.SIGKILL)
            append_record(job["results"], {"run": job["run"], "broker_killed_at": step.value})
            return
        if (job.get("stop_at") is not None and not phase.get("stopped") and phase["txn"] == crash_txn
                and step.value == job["stop_at"]):
            # Takeover tests: stop here (SIGSTOP), once (PRODUCED comes once per record), until the
            # parent lets us go on (SIGCONT) or kills us.
            phase["stopped"] = True
            append_record(job["marker"], {"run": job["run"], "pid": os.getpid(), "step": step.value})
            # Thread-directed, so that this thread stops before it runs on (see recipes/pool/_pool_worker.py).
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            return
        if phase["name"] == "recover":
            if step.value == job.get("recovery_point"):
                kill_self()
            return
        if phase["racing"] and step is Step.DB_COMMITTED:
            time.sleep(2.0)  # the killer thread fires during this wait at the latest
            kill_self()
        if phase["txn"] != crash_txn or step.value != point:
            return
        if step is Step.DB_COMMITTING:
            # "COMMIT sent, reply not received": die somewhere between 10 us and 30 ms into
            # the COMMIT (log-uniform), so that both outcomes occur on fast and slow databases.
            # ``race_delay`` narrows the range (decimal exponents of seconds) toward one side.
            phase["racing"] = True
            # The killer thread needs the GIL, which this thread keeps for up to the switch interval (5 ms)
            # while a pure-Python driver (PyMySQL) builds and sends the COMMIT: without a short interval
            # the kill never lands before the COMMIT leaves (MariaDB committed 60 of 60 in one CI run).
            sys.setswitchinterval(1e-6)
            low, high = job.get("race_delay", RACE_DELAY)
            threading.Timer(10 ** rng.uniform(low, high), kill_self).start()
            return
        kill_self()

    return hook


def run_job(job: dict[str, Any]) -> None:
    """Run one crash job in this (forked) process; normally it ends with SIGKILL."""
    from kafka2pc.recipes.dual_write import DualWriter, define_state_table

    connect_args: dict[str, Any] = (
        {"timeout": job["sqlite_timeout"]} if "sqlite_timeout" in job and job["db_url"].startswith("sqlite") else {}
    )
    if job["db_url"].startswith("postgresql"):
        connect_args["application_name"] = session_name(os.getpid())  # see Zygote.run
    engine = sa.create_engine(job["db_url"], poolclass=sa.pool.NullPool, connect_args=connect_args)
    metadata = sa.MetaData()
    states = define_state_table(metadata)
    items = items_table(metadata)
    phase: dict[str, Any] = {"name": "recover", "txn": -1, "racing": False}
    hook = step_hook(job, phase)

    config = {"bootstrap.servers": job["bootstrap"], "transactional.id": job["tid"]}
    config.update(job.get("producer_config", {}))
    writer = DualWriter(
        engine, config, state_table=states, on_step=hook, retain_records=job.get("retain", False),
        lock_timeout_s=job.get("lock_timeout_s"),
    )
    if job.get("recovery_kill_after_s") is not None:
        threading.Timer(job["recovery_kill_after_s"], kill_self).start()
    try:
        result = writer.recover(on_heuristic="report")
    except Exception as exc:
        if not job.get("record_errors"):
            raise
        append_record(job["results"], {"run": job["run"], "role": job.get("role"), "recover_error": type(exc).__name__})
        return
    settlement = result.settlement
    append_record(
        job["results"],
        {
            "run": job["run"],
            "role": job.get("role"),
            "decision": settlement.plan.decision.value if settlement else None,
            "outcome": settlement.outcome.value if settlement else None,
            "heuristic": result.heuristic,
            "republished": result.republished,
        },
    )
    if job.get("recover_only"):
        if job.get("hang_after"):
            kill_self()
        return
    phase["name"] = "work"
    if job.get("mode") == "ctp":
        _consume_transform_produce(job, engine, items, writer, phase)
        return
    topic = job["topic"]
    # Odd runs write through an ORM Session: on PostgreSQL its state update and COMMIT are two
    # round trips, on a Connection one (the recipe's two code paths, both killed at every step).
    use_session = job.get("session", job["run"] % 2 == 1)
    if job.get("record_errors"):
        try:
            _transactions(job, engine, items, writer, phase, topic, use_session)
        except Exception as exc:  # noqa: BLE001 - reported to the parent through the results file
            append_record(job["results"], {"run": job["run"], "role": job.get("role"), "error": type(exc).__name__,
                                     "message": str(exc)[:300]})
            return
        append_record(job["results"], {"run": job["run"], "role": job.get("role"), "error": None})
        return
    _transactions(job, engine, items, writer, phase, topic, use_session)
    if job.get("hang_after"):
        kill_self()


def _transactions(
    job: dict[str, Any], engine: sa.Engine, items: sa.Table, writer: Any, phase: dict[str, Any], topic: str,
    use_session: bool,
) -> None:
    acks = ack_log(job)
    for j in range(job.get("transactions", 2)):
        phase["txn"] = j
        rids = [f"{job['series']}:{job['run']}-{j}-{m}" for m in range(job.get("records", 2))]
        with contextlib.ExitStack() as stack:
            bind: Any = stack.enter_context(Session(engine) if use_session else engine.connect())
            tx = stack.enter_context(writer.transaction(bind))
            for rid in rids:
                bind.execute(items.insert().values(id=rid, series=job["series"]))
                tx.produce(topic, value=rid.encode(), key=rid.encode())
        acknowledge(acks, rids)  # the block returned: acknowledged to the application


def _consume_transform_produce(
    job: dict[str, Any], engine: sa.Engine, items: sa.Table, writer: Any, phase: dict[str, Any]
) -> None:
    """Exactly once from ``job["input"]`` into the database and ``job["topic"]``, in batches.

    Consumer offsets travel in the same two-phase transaction as the rows and
    the output records, so a restart resumes exactly where the last committed
    transaction left off.
    """
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({
        "bootstrap.servers": job["bootstrap"], "group.id": job["group"], "isolation.level": "read_committed",
        "enable.auto.commit": False, "auto.offset.reset": "earliest", "enable.partition.eof": False,
    })
    assign_at_committed(consumer, [TopicPartition(job["input"], 0)])
    acks = ack_log(job)
    batch = 0
    idle_since = time.monotonic()
    try:
        while True:
            position = consumer.position([TopicPartition(job["input"], 0)])[0].offset
            if position >= job["input_count"]:
                return
            got = consumer.consume(num_messages=job.get("batch", 5), timeout=1.0)
            for m in got:
                if m.error():
                    sys.stderr.write(f"run {job['run']}: consumer error {m.error()}\n")
            messages = [m for m in got if not m.error()]
            if not messages:
                if time.monotonic() - idle_since > 60:
                    raise TimeoutError(f"run {job['run']}: no input record in 60 s at position {position}")
                continue
            idle_since = time.monotonic()
            phase["txn"] = batch
            with engine.connect() as conn, writer.transaction(conn) as tx:
                for m in messages:
                    rid = m.value().decode()
                    conn.execute(items.insert().values(id=rid, series=job["series"]))
                    tx.produce(job["topic"], value=rid.encode(), key=m.key())
                tx.send_consumer_offsets(consumer)
            acknowledge(acks, [m.value().decode() for m in messages])
            batch += 1
    finally:
        consumer.close()


def zygote() -> None:
    """Import the sync writer's dependencies, then serve jobs with :func:`run_job`."""
    # Imported once here, before any thread exists; every forked child inherits them.
    import confluent_kafka
    import confluent_kafka.admin  # noqa: F401
    import kafka  # noqa: F401
    import kafka2pc.recipes.dual_write
    import sqlalchemy.dialects.mysql
    import sqlalchemy.dialects.postgresql
    import sqlalchemy.dialects.sqlite  # noqa: F401

    with contextlib.suppress(ImportError):
        import pymysql  # noqa: F401

    import kafka2pc._producer
    import kafka2pc._recovery  # noqa: F401

    serve(run_job)


def serve(run: Callable[[dict[str, Any]], None]) -> None:
    """The zygote's loop: read jobs from stdin, fork a child per job that runs ``run(job)``, report its end."""
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.dup2(2, 1)  # keep the protocol channel clean
            # A child still running when its parent is about to give up prints where it is (into the log).
            if "stacks_after_s" in job:  # set by Zygote.run
                faulthandler.dump_traceback_later(job["stacks_after_s"], exit=False)
            code = 0
            try:
                run(job)
            except BaseException as exc:  # noqa: BLE001 - reported through the exit code
                import traceback

                traceback.print_exc()
                sys.stderr.write(f"job {job.get('run')} failed: {exc!r}\n")
                code = 3
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        out.write(json.dumps({"pid": pid, "exit": code}) + "\n")
        out.flush()


def _wait_for_sessions_to_end(job: dict[str, Any], pid: int) -> None:
    import psycopg

    url = sa.make_url(job["db_url"]).set(drivername="postgresql").render_as_string(hide_password=False)
    deadline = time.monotonic() + 30
    with psycopg.connect(url, autocommit=True) as conn:
        while conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                           (session_name(pid),)).fetchone() != (0,):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the database sessions of run {job['run']} did not end in 30 s")
            time.sleep(0.01)


class Zygote:
    """The parent's handle on one zygote process (``python -m <module> --zygote``)."""

    #: The worker module the zygote runs: its ``zygote()`` imports what the children need.
    module = "harness.dw_crash"
    #: Directories put first on the zygote's ``PYTHONPATH`` (besides ``tests/`` and the checkout).
    pythonpath: tuple[str, ...] = ()

    def __init__(self, log_path: Path) -> None:
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", self.module, "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
            env=child_env(**({"PYTHONPATH": os.pathsep.join([*self.pythonpath, child_env()["PYTHONPATH"]])}
                             if self.pythonpath else {})),
        )
        ready = self._read(timeout=60)
        if ready != "ready":
            raise RuntimeError(f"zygote did not start: {ready!r} (see {log_path})")

    def _read(self, timeout: float) -> str:
        assert self._proc.stdout is not None
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self._proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        if not result:
            self._proc.kill()
            self._log.flush()
            tail = Path(self._log.name).read_text(errors="replace")[-6000:]
            raise TimeoutError(f"zygote gave no answer in {timeout}s; the end of its log:\n{tail}")
        return result[0].strip()

    def run(self, job: dict[str, Any], timeout: float = 120.0) -> int:
        """Run ``job`` in a fresh child; return its exit code (``-9`` when it killed itself).

        Returns once the database finished what the child sent: a child killed
        right after it sent COMMIT leaves a PostgreSQL backend that may still be
        committing, and the database's outcome of the killed transaction is only
        known once that backend ended (it does as soon as it finished the COMMIT
        and found the connection closed).
        """
        assert self._proc.stdin is not None
        job = {"stacks_after_s": max(1.0, timeout - 15), **job}
        self._proc.stdin.write(json.dumps(job) + "\n")
        self._proc.stdin.flush()
        answer = json.loads(self._read(timeout))
        if job["db_url"].startswith("postgresql"):
            _wait_for_sessions_to_end(job, int(answer["pid"]))
        return int(answer["exit"])

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._log.close()


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    zygote()
