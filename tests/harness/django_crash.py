"""Crash-test worker for the Django app (kafka2pc.recipes.django): the dual-write zygote's jobs, through Django.

The same jobs, kill points and results as :mod:`harness.dw_crash` (the crash matrix of
:mod:`harness.crash_matrix` drives both), but each child is a Django process: it configures Django
for the job's database (``settings.configure``, the app and the test project's ``Item`` model on
``dw_items``), calls :func:`kafka2pc.recipes.django.recover` (the worker-start recovery) and writes with
``with dual_write() as tx: Item.objects.create(...); tx.produce(...)``.  The job's ``tid`` is the pool's
prefix; the pool has one id, ``<tid>-0``, so one series exercises one transactional id as the
SQLAlchemy matrix does.  Leases last ``LEASE_S``: a restarted child settles its dead predecessor's id once
the lease expired.  Each acknowledged write (its ``with`` block returned) is appended to
``<results>.acks`` (:class:`harness.acks.AckLog`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from harness.acks import AckLog
from harness.dw_crash import Zygote, append_record, kill_self, serve, step_hook

#: The lease of the crash children's pool: a restarted child waits up to this long for its predecessor's.
LEASE_S = 1.0
TESTS_DJANGO = Path(__file__).resolve().parents[1] / "django"


def django_database(db_url: str) -> dict[str, Any]:
    """Django's ``DATABASES`` entry for a SQLAlchemy URL of the suite (SQLite file, PostgreSQL, MariaDB)."""
    url = sa.make_url(db_url)
    backend = url.get_backend_name()
    if backend == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": url.database, "OPTIONS": {"timeout": 10}}
    engine = {"postgresql": "django.db.backends.postgresql", "mysql": "django.db.backends.mysql"}[backend]
    return {"ENGINE": engine, "NAME": url.database, "USER": url.username or "", "PASSWORD": url.password or "",
            "HOST": url.host or "127.0.0.1", "PORT": str(url.port or "")}


def ack_log(job: dict[str, Any]) -> AckLog:
    """The log the harness names (``ack_log``), else one beside the results file."""
    return AckLog(job.get("ack_log") or job["results"] + ".acks")


def _configure(job: dict[str, Any], hook: Any) -> None:
    import django
    from django.conf import settings

    settings.configure(
        DATABASES={"default": django_database(job["db_url"])},
        INSTALLED_APPS=["kafka2pc.recipes.django", "djtest"],
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
        KAFKA2PC={
            "PRODUCER": {"bootstrap.servers": job["bootstrap"], **job.get("producer_config", {})},
            "TRANSACTIONAL_ID_PREFIX": job["tid"],
            "POOL_SIZE": 1,
            "POOL_OPTIONS": {"lease_s": job.get("lease_s", LEASE_S), "max_slots": 1, "on_step": hook,
                             "acquire_timeout_s": 60.0, "pipelined": bool(job.get("pipelined")),
                             **({"owner": f"{job['owner']}:{os.getpid()}"} if job.get("owner") else {})},
        },
    )
    django.setup()


def _ensure_lease_table(db_url: str) -> None:
    """The crash matrix's ``prepare_db`` creates the state and item tables; the pool needs its lease table too."""
    from kafka2pc.recipes.dual_write import define_lease_table

    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        with contextlib.suppress(sa.exc.SQLAlchemyError):  # created concurrently by another series' child
            define_lease_table(sa.MetaData()).create(engine, checkfirst=True)
    finally:
        engine.dispose()


def _wait_for_lease(db_url: str, tid: str, timeout: float) -> None:
    """Wait until ``tid``'s lease is free or expired (its holder, a killed child, stopped renewing).

    Expiry is judged on this process's UTC clock, as the pool judges it.
    """
    from kafka2pc.recipes.dual_write import define_lease_table
    from kafka2pc.recipes.dual_write._lease import utcnow

    table = define_lease_table(sa.MetaData())
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                row = conn.execute(sa.select(table.c.owner, table.c.expires_at)
                                   .where(table.c.transactional_id == tid)).first()
            if row is None or row[0] is None or (row[1] is not None and row[1] < utcnow()):
                return
            time.sleep(0.05)
    finally:
        engine.dispose()


def _background_commits_numbered(hook: Any, phase: dict[str, Any]) -> Any:
    """The hook of a pipelined child: ``kafka_committed`` counts as a step of the transaction it commits.

    It comes in the pool's commit thread, while the child's thread may have moved on to its next
    transaction (``phase["txn"]``).  The pool has one slot, so the background commits end in order:
    the n-th one of the work phase is transaction n's.
    """
    from kafka2pc.recipes.dual_write import Step

    def numbered(step: Any) -> None:
        if step is not Step.KAFKA_COMMITTED or phase["name"] != "work":
            hook(step)
            return
        # The child's thread waits for the slot meanwhile: it reads ``phase`` again only after this returns.
        current, phase["txn"] = phase["txn"], phase.get("kafka_commits", 0)
        phase["kafka_commits"] = phase["txn"] + 1
        try:
            hook(step)
        finally:
            phase["txn"] = current

    return numbered


def run_job(job: dict[str, Any]) -> None:
    """Run one crash job in this (forked) process; normally it ends with SIGKILL."""
    phase: dict[str, Any] = {"name": "recover", "txn": -1, "racing": False}
    hook = step_hook(job, phase)
    if job.get("pipelined"):
        hook = _background_commits_numbered(hook, phase)
    _ensure_lease_table(job["db_url"])
    _configure(job, hook)
    from kafka2pc.recipes.django import recover

    tid = f"{job['tid']}-0"
    if job.get("survive_s") is not None:
        # A survivor: recover() at start (nothing has expired yet), then keep running while the pool's
        # own orphan scan settles what a killed worker left, once its lease expired.
        recover()
        time.sleep(job["survive_s"])
        return
    _wait_for_lease(job["db_url"], tid, timeout=job.get("lease_s", LEASE_S) + 30)
    if job.get("recovery_kill_after_s") is not None:
        threading.Timer(job["recovery_kill_after_s"], kill_self).start()
    results = recover(wait_s=job.get("lease_s", LEASE_S) + 30)
    mine = [r for r in results if r.transactional_id == tid]
    if any(not r.ok for r in mine):
        raise RuntimeError(f"recovery failed: {mine}")
    settlement = mine[-1].settlement if mine else None
    append_record(job["results"], {
        "run": job["run"],
        "decision": settlement.plan.decision.value if settlement else "nothing",
        "outcome": settlement.outcome.value if settlement else None,
        "heuristic": any(r.heuristic for r in mine),
        "republished": 0,
    })
    if job.get("recover_only"):
        if job.get("hang_after"):
            kill_self()
        return
    phase["name"] = "work"
    if job.get("record_errors"):
        try:
            _transactions(job, phase)
        except Exception as exc:  # noqa: BLE001 - reported to the parent through the results file
            append_record(job["results"], {"run": job["run"], "role": job.get("role"), "error": type(exc).__name__,
                                           "message": str(exc)[:300]})
            return
        append_record(job["results"], {"run": job["run"], "role": job.get("role"), "error": None})
        return
    _transactions(job, phase)
    if job.get("hang_after"):
        kill_self()


def _transactions(job: dict[str, Any], phase: dict[str, Any]) -> None:
    from djtest.models import Item
    from kafka2pc.recipes.django import dual_write
    from kafka2pc.recipes.django._runtime import existing_runtime

    acks = ack_log(job)
    for j in range(job.get("transactions", 2)):
        phase["txn"] = j
        ids = [f"{job['series']}:{job['run']}-{j}-{m}" for m in range(job.get("records", 2))]
        responding = job.get("point") == "responded" and j == job.get("crash_txn")
        with dual_write() as tx:
            for rid in ids:
                Item.objects.create(id=rid, series=job["series"])
                tx.produce(job["topic"], value=rid.encode(), key=rid.encode())
            if responding:
                _hold_kafka_commit(tx)
        for rid in ids:
            acks.record(rid)
        if responding:
            # The response is out; its Kafka commit runs in the pool's background: die now.
            in_flight = existing_runtime("default").pool.metrics().commits_in_flight  # type: ignore[union-attr]
            append_record(job["results"] + ".inflight", {"run": job["run"], "in_flight": in_flight})
            kill_self()
    if job.get("pipelined"):
        # A kill at ``kafka_committed`` comes in the commit thread: wait for it (os._exit would not).
        existing_runtime("default").pool.wait_visible(60)  # type: ignore[union-attr]


def _hold_kafka_commit(tx: Any) -> None:
    """Hold this block's background Kafka commit before it sends anything, until the child is killed.

    The block still returns at the database COMMIT: the kill then lands after the response with the
    Kafka transaction only prepared, every time (a commit left to run usually reaches the broker first).
    The producer's method is wrapped on the instance, the way kafka2pc.otel instruments a producer.
    """
    producer = tx._producer
    commit = producer.commit_transaction

    def held(timeout: float | None = None) -> None:
        threading.Event().wait(60)  # the kill comes first
        commit(timeout)

    producer.commit_transaction = held


def zygote() -> None:
    """Import Django, its backends and the app's dependencies once, then serve jobs with :func:`run_job`."""
    import pymysql

    pymysql.version_info = (2, 2, 1, "final", 0)  # type: ignore[assignment]  # Django asks for mysqlclient >= 2.2.1
    pymysql.install_as_MySQLdb()
    import confluent_kafka
    import confluent_kafka.admin  # noqa: F401
    import django
    import django.db.backends.mysql.base
    import django.db.backends.postgresql.base
    import django.db.backends.sqlite3.base  # noqa: F401
    import kafka  # noqa: F401
    import kafka2pc.recipes.dual_write
    import sqlalchemy.dialects.mysql
    import sqlalchemy.dialects.postgresql
    import sqlalchemy.dialects.sqlite  # noqa: F401

    import kafka2pc._producer
    import kafka2pc._recovery  # noqa: F401

    serve(run_job)


class DjangoZygote(Zygote):
    """A zygote whose children write through the Django app; the crash matrix runs it like :class:`Zygote`."""

    module = "harness.django_crash"
    pythonpath = (str(TESTS_DJANGO),)  # djtest, the test project's app, as pytest's `pythonpath` setting has it

    def final_recovery(self, engine: sa.Engine, bootstrap: str, tid: str) -> dict[str, Any]:
        """The matrix's last recovery, in a Django child (``recover()`` at a worker's start), as ``recover_here``."""
        url = engine.url.render_as_string(hide_password=False)
        with tempfile.TemporaryDirectory() as tmp:
            results = os.path.join(tmp, f"final-{uuid.uuid4().hex[:6]}.jsonl")
            code = self.run({"db_url": url, "bootstrap": bootstrap, "tid": tid, "results": results, "run": -1,
                             "recover_only": True})
            assert code == 0, f"the final recovery child exited {code}"
            (found,) = [json.loads(line) for line in Path(results).read_text().splitlines()]
        return {"decision": found["decision"], "heuristic": found["heuristic"]}


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    zygote()
