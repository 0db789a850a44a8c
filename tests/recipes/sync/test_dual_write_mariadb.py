"""MySQL/MariaDB specifics of the dual-write recipe: the state row's schema, the operator CLI with a
MySQL URL.  The crash matrices, takeovers and misuse tests run on MariaDB too (``mariadb`` parameters in
``test_dual_write_crash.py``, ``test_dual_write_takeover.py``, ``test_dual_write_misuse.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import sqlalchemy as sa
from harness.dw_crash import Zygote, check_consistency, items_table
from kafka2pc.recipes.dual_write import DualWriter, MySQLStore, define_outbox_table, define_state_table, store_for

from kafka2pc.testing import create_topic


def _cli(bootstrap: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "kafka2pc"), "--bootstrap-server", bootstrap, "--timeout", "60", *args,
         "--output", "json"],
        capture_output=True, text=True, timeout=120,
    )


def test_state_row_version_keeps_microseconds_and_moves_forward(mariadb_url: str, kafka_bootstrap: str) -> None:
    engine = sa.create_engine(mariadb_url)
    metadata = sa.MetaData()
    states = define_state_table(metadata)
    metadata.create_all(engine)
    assert isinstance(store_for(engine.dialect, states), MySQLStore)
    writer = DualWriter(engine, {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"dw-v-{uuid.uuid4().hex}"},
                        state_table=states)
    writer.recover()
    seen = []
    topic = create_topic(kafka_bootstrap)
    for _ in range(5):  # several commits within one second: every one moves the version forward
        with engine.connect() as conn, writer.transaction(conn) as tx:
            tx.produce(topic, value=b"v")
        with engine.connect() as conn:
            seen.append(conn.execute(sa.select(states.c.updated_at)
                                     .where(states.c.transactional_id == writer.transactional_id)).scalar_one())
    assert seen == sorted(seen) and len(set(seen)) == 5
    assert any(v.microsecond for v in seen)  # DATETIME(6): not rounded to seconds
    writer.close()
    engine.dispose()


def _killed_child(
    mariadb_url: str, kafka_bootstrap: str, tmp_path: Path, prefix: str, point: str
) -> tuple[sa.Engine, str, str, str]:
    """The recipe's tables, and a child that ran two transactions and was SIGKILLed at ``point`` of the second."""
    engine = sa.create_engine(mariadb_url, poolclass=sa.pool.NullPool)
    metadata = sa.MetaData()
    define_state_table(metadata)
    define_outbox_table(metadata)
    items_table(metadata)
    metadata.create_all(engine)
    series = f"{prefix}-{uuid.uuid4().hex[:8]}"
    tid, topic = f"dw-{series}", create_topic(kafka_bootstrap)
    zygote = Zygote(tmp_path / "zygote.log")
    try:
        job = {"db_url": mariadb_url, "bootstrap": kafka_bootstrap, "tid": tid, "topic": topic, "series": series,
               "results": str(tmp_path / "r.jsonl"), "run": 0, "point": point, "crash_txn": 1,
               "transactions": 2, "records": 2}
        assert zygote.run(job) == -9
    finally:
        zygote.close()
    return engine, series, tid, topic


def test_cli_in_doubt_and_recover_with_a_mysql_url(mariadb_url: str, kafka_bootstrap: str, tmp_path: Path) -> None:
    """A child killed between its database commit and its Kafka commit; the CLI, given a plain
    ``mysql://`` URL, reports the transaction in doubt and then commits it."""
    engine, series, tid, topic = _killed_child(mariadb_url, kafka_bootstrap, tmp_path, "cli", "db_committed")
    url = sa.make_url(mariadb_url).set(drivername="mysql").render_as_string(hide_password=False)
    listed = _cli(kafka_bootstrap, "in-doubt", "--db-url", url)
    entries = {e["transactional_id"]: e for e in json.loads(listed.stdout)["entries"]}
    assert entries[tid]["decision"] == "commit", listed.stderr
    recovered = _cli(kafka_bootstrap, "recover", "--db-url", url)
    assert recovered.returncode == 0, recovered.stderr
    entries = {e["transactional_id"]: e for e in json.loads(recovered.stdout)["entries"]}
    assert entries[tid]["decision"] == "commit" and entries[tid]["outcome"] == "committed"
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, series)
    assert not problems and rows == records == 4
    engine.dispose()


def test_cli_in_doubt_dry_run_and_recover_abort_with_a_mariadb_url(
    mariadb_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A child killed after storing its state but before COMMIT (the database rolled back, Kafka holds a
    prepared transaction); with a plain ``mariadb://`` URL the CLI decides abort, ``--dry-run`` changes
    nothing, ``recover`` aborts it: the rolled-back rows' records are never visible and nothing hangs."""
    engine, series, tid, topic = _killed_child(mariadb_url, kafka_bootstrap, tmp_path, "cli-abort", "state_stored")
    url = sa.make_url(mariadb_url).set(drivername="mariadb").render_as_string(hide_password=False)
    for command in (("in-doubt",), ("recover", "--dry-run")):
        shown = _cli(kafka_bootstrap, *command, "--db-url", url)
        entries = {e["transactional_id"]: e for e in json.loads(shown.stdout)["entries"]}
        assert entries[tid]["decision"] == "abort", shown.stdout + shown.stderr
        assert entries[tid]["kafka_state"] == "Ongoing" and entries[tid]["outcome"] is None, shown.stdout
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, series)
    assert rows == records == 2 and problems and "hanging" in problems[-1]  # the dry run left it open
    recovered = _cli(kafka_bootstrap, "recover", "--db-url", url)
    assert recovered.returncode == 0, recovered.stderr
    entries = {e["transactional_id"]: e for e in json.loads(recovered.stdout)["entries"]}
    # The open transaction is aborted; the stored one (the first transaction's state) stays committed.
    assert entries[tid]["decision"] == "abort" and entries[tid]["outcome"] == "committed", recovered.stdout
    assert entries[tid]["kafka_state"] == "Ongoing", recovered.stdout
    rows, records, problems = check_consistency(engine, kafka_bootstrap, topic, series)
    assert not problems and rows == records == 2
    engine.dispose()
