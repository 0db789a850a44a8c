"""The dual-write recipe in one process: normal path, rollback, locking, unknown COMMIT outcomes, metrics.

Real broker, real PostgreSQL and SQLite.  Process crashes are in
``test_dual_write_crash.py``; broker restarts in ``test_dual_write_broker.py``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from harness.dw_crash import Zygote
from harness.env import Env, session_committing_apart
from kafka2pc.recipes.dual_write import (
    DualWriteMetrics,
    DualWriter,
    Step,
    define_state_table,
    recover_all,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from kafka2pc import (
    IndefiniteOutcomeError,
    Kafka2pcError,
    PreparedTxnState,
    ProducerFencedError,
)
from kafka2pc.testing import create_topic, end_offsets


class Hook:
    """An ``on_step`` callback whose behaviour a test switches on and off (``hook.fn = ...``)."""

    def __init__(self) -> None:
        self.fn: Any = None

    def __call__(self, step: Step) -> None:
        if self.fn is not None:
            self.fn(step)


@pytest.fixture
def env(db_url: str, kafka_bootstrap: str) -> Iterator[Env]:
    e = Env(db_url, kafka_bootstrap)
    yield e
    e.engine.dispose()


@pytest.fixture
def pg_env(pg_url: str, kafka_bootstrap: str) -> Iterator[Env]:
    e = Env(pg_url, kafka_bootstrap)
    yield e
    e.engine.dispose()


# -- schema ---------------------------------------------------------------------------


def test_state_table_has_the_documented_shape_and_a_configurable_name(db_url: str) -> None:
    metadata = sa.MetaData()
    table = define_state_table(metadata, "orders_kafka_state")
    assert define_state_table(metadata, "orders_kafka_state") is table  # idempotent on one MetaData
    engine = sa.create_engine(db_url)
    metadata.create_all(engine)
    columns = {c["name"]: c for c in sa.inspect(engine).get_columns("orders_kafka_state")}
    assert list(columns) == ["transactional_id", "prepared_txn_state", "updated_at"]
    assert columns["transactional_id"]["type"].length == 255 and not columns["transactional_id"]["nullable"]
    assert columns["prepared_txn_state"]["type"].length == 255 and columns["prepared_txn_state"]["nullable"]
    assert isinstance(columns["updated_at"]["type"], (sa.TIMESTAMP, sa.DateTime))
    assert sa.inspect(engine).get_pk_constraint("orders_kafka_state")["constrained_columns"] == ["transactional_id"]
    engine.dispose()


# -- normal path --------------------------------------------------------------------------


class _Base(DeclarativeBase):
    pass


class Order(_Base):
    __tablename__ = "dw_orders"
    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    series: Mapped[str] = mapped_column(sa.String(64))


def test_connection_and_session_commit_both_sides_and_store_the_state(env: Env) -> None:
    _Base.metadata.create_all(env.engine)
    writer = env.writer()
    first = writer.recover()
    assert first.settlement is not None and first.settlement.plan.decision.value == "nothing"
    assert first.stored_state.is_empty

    with env.engine.connect() as conn:  # Connection, autobegun
        with writer.transaction(conn) as tx:
            env.write(conn, tx, "c-1")
        assert tx.prepared_state is not None and not tx.prepared_state.is_empty
    with Session(env.engine) as session:  # ORM Session: rows flushed before prepare
        with writer.transaction(session) as tx:
            session.add(Order(id=f"{env.series}:o-1", series=env.series))
            env.write(session, tx, "s-1")
        assert session.get(Order, f"{env.series}:o-1") is not None

    with env.engine.connect() as conn:
        stored = conn.execute(sa.select(env.states).where(env.states.c.transactional_id == writer.transactional_id)).one()
    assert PreparedTxnState(stored.prepared_txn_state) == tx.prepared_state  # the last transaction's state
    assert stored.updated_at is not None
    assert sorted(env.records_in_order()) == ["c-1", "s-1"]
    env.assert_consistent()
    assert writer.metrics().transactions_committed == 2
    writer.close()


def test_a_transactional_id_with_quotes_and_backslashes_is_stored_verbatim(env: Env) -> None:
    """The state update quotes its values itself on PostgreSQL (no parameters: one round trip with COMMIT)."""
    tid = f"dw-{env.series}-o'brien\\'; DROP TABLE x; --\"é"
    writer = env.writer(tid)
    writer.recover()
    for rid in ("q-1", "q-2"):  # the second update is guarded by the first one's token and state
        with env.engine.connect() as conn, writer.transaction(conn) as tx:
            env.write(conn, tx, rid)
    with env.engine.connect() as conn:
        stored = conn.execute(sa.select(env.states).where(env.states.c.transactional_id == tid)).one()
    assert stored.transactional_id == tid
    assert tx.prepared_state is not None and PreparedTxnState(stored.prepared_txn_state) == tx.prepared_state
    assert sorted(env.records_in_order()) == ["q-1", "q-2"]
    env.assert_consistent()
    writer.close()
    again = env.writer(tid)
    assert again.recover().stored_state == PreparedTxnState(stored.prepared_txn_state)
    again.close()


def test_an_exception_before_the_database_commit_rolls_back_both(env: Env) -> None:
    control = Hook()
    writer = env.writer(on_step=control)
    writer.recover()
    env.commit_one(writer, "kept")
    for failing_step in (None, Step.PREPARED, Step.STATE_STORED, Step.DB_COMMITTING):
        def hook(step: Step, failing_step: Step | None = failing_step) -> None:
            if step is failing_step:
                raise RuntimeError(f"injected at {step.value}")

        control.fn = hook
        with pytest.raises(RuntimeError), env.engine.connect() as conn, writer.transaction(conn) as tx:
            env.write(conn, tx, f"lost-{failing_step}")
            if failing_step is None:
                raise RuntimeError("application error")
    control.fn = None
    env.commit_one(writer, "kept-2")  # the writer is still usable
    assert env.rows() == {"kept", "kept-2"}
    assert sorted(env.records_in_order()) == ["kept", "kept-2"]
    env.assert_consistent()
    assert writer.metrics().transactions_rolled_back == 4
    writer.close()


def test_recovery_commits_a_transaction_left_prepared_after_the_database_commit(env: Env) -> None:
    """A writer that stops between the two commits (here: the step hook raises) leaves a prepared transaction."""

    class Stop(BaseException):
        pass

    def stop_after_db_commit(step: Step) -> None:
        if step is Step.DB_COMMITTED:
            raise Stop

    writer = env.writer(on_step=stop_after_db_commit)
    writer.recover()
    with pytest.raises(Stop):
        env.commit_one(writer, "in-doubt")
    assert env.rows() == {"in-doubt"} and env.records_in_order() == []  # the database committed, Kafka not yet
    assert end_offsets(env.bootstrap, env.topic, "read_committed") != end_offsets(env.bootstrap, env.topic)
    writer.close()

    again = env.writer()
    result = again.recover()
    assert result.settlement is not None and result.settlement.plan.decision.value == "commit"
    assert env.records_in_order() == ["in-doubt"]
    second = again.recover()  # idempotent
    assert second.settlement is not None and second.settlement.plan.decision.value == "nothing"
    assert second.settlement.outcome.value == "committed"
    env.assert_consistent()
    again.close()


def test_recover_all_settles_many_transactional_ids_in_parallel(pg_env: Env) -> None:
    class Stop(BaseException):
        pass

    def stop(step: Step) -> None:
        if step is Step.DB_COMMITTED:
            raise Stop

    tids = [f"dw-{pg_env.series}-shard-{i}" for i in range(4)]
    for i, tid in enumerate(tids):
        writer = pg_env.writer(tid, on_step=stop if i % 2 == 0 else None)
        writer.recover()
        try:
            pg_env.commit_one(writer, f"shard-{i}")
        except Stop:
            pass
        writer.close()
    writers = [pg_env.writer(tid) for tid in tids]
    results = recover_all(writers)
    assert sorted(results) == sorted(tids)
    decisions = [results[tid].settlement.plan.decision.value for tid in tids]  # type: ignore[union-attr]
    assert decisions == ["commit", "nothing", "commit", "nothing"]
    assert all(r.error is None and not r.heuristic for r in results.values())
    assert sorted(pg_env.records_in_order()) == [f"shard-{i}" for i in range(4)]
    pg_env.assert_consistent()
    snapshot = DualWriteMetrics.aggregate(w.metrics() for w in writers)
    assert snapshot.writers == 4 and snapshot.recoveries == 4 and snapshot.in_doubt_transactions == 0
    for w in writers:
        w.close()


# -- two instances, one transactional id ------------------------------------------------------


@pytest.mark.parametrize(
    ("paused_at", "second_settles_first"),
    [("body", False), ("storing", False), ("storing", True)],
    ids=["in-body", "storing-first-commits", "storing-second-commits"],
)
def test_two_instances_with_the_same_transactional_id_do_not_corrupt_each_other(
    env: Env, db_url: str, paused_at: str, second_settles_first: bool
) -> None:
    """The KIP's split brain: the state row serializes them, Kafka's epoch fences the older one.

    The first instance is paused inside its block ("body") or between its
    state update and its COMMIT ("storing", on a Session whose COMMIT is a
    round trip of its own) while a second instance with the same id recovers.

    * While the first holds the state row's lock (SQLite: from its first
      statement, PostgreSQL: from its state update) the second's recovery
      waits, then settles the first's transaction from the state the first
      committed: the first's own Kafka commit got there first
      ("first-commits": nothing open) or the second commits it and the first's
      Kafka commit is fenced ("second-commits": the first sees the outcome is
      committed and returns normally).
    * PostgreSQL, paused in the body: no lock is held yet (the optimistic
      path), so the second takes over at once, aborting the first's open
      Kafka transaction; the first learns it at its prepare or its guarded
      state update and rolls back both sides.

    Either way the first is fenced afterwards and its next transaction changes nothing.
    """
    sqlite = db_url.startswith("sqlite")
    recovered = threading.Event()
    paused, release = threading.Event(), threading.Event()
    first_kafka_committed = threading.Event()

    def first_pauses(step: Step) -> None:
        if paused_at == "storing" and step is Step.DB_COMMITTING:
            paused.set()
            release.wait(10)
        if second_settles_first and step is Step.DB_COMMITTED:
            assert recovered.wait(30)  # the second recovers between our two commits
        if step is Step.KAFKA_COMMITTED:
            first_kafka_committed.set()

    def second_waits(step: Step) -> None:
        # "first-commits": the first's database COMMIT released the row to the second's recovery, and
        # the first's Kafka commit is on its way; let it land before the second touches Kafka (else the
        # second may find it still open and commit it itself: the "second-commits" case, not this one).
        if paused_at == "storing" and not second_settles_first and step is Step.RECOVERY_CLAIMED:
            assert first_kafka_committed.wait(30)

    control = Hook()
    first = env.writer(on_step=control)
    first.recover()
    env.commit_one(first, "a-1")
    control.fn = first_pauses
    errors: list[BaseException] = []

    def first_holds_a_transaction() -> None:
        try:
            with session_committing_apart(env.engine) as session, first.transaction(session) as tx:
                env.write(session, tx, "a-2")
                if paused_at == "body":
                    # Delivered, the record's partition is registered: the transaction is Ongoing at the
                    # coordinator, and the second's recovery finds it open (else it may not have begun there).
                    assert first.producer is not None and first.producer.flush(10) == 0
                    paused.set()
                    release.wait(10)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    holder = threading.Thread(target=first_holds_a_transaction)
    holder.start()
    assert paused.wait(10)
    second_engine = sa.create_engine(env.engine.url)
    second = DualWriter(
        second_engine, {"bootstrap.servers": env.bootstrap, "transactional.id": first.transactional_id},
        state_table=env.states, on_step=second_waits,
    )
    results: list[Any] = []
    recovery = threading.Thread(target=lambda: (results.append(second.recover()), recovered.set()))
    recovery.start()
    taken_over = paused_at == "body" and not sqlite
    if taken_over:
        assert recovered.wait(30)  # PostgreSQL: nothing locks the row while the first is in its block
    else:
        assert not recovered.wait(1.5)  # the second's recovery waits for the row lock the first holds
    release.set()
    holder.join(60)
    recovery.join(60)
    assert recovered.is_set()
    decision = results[0].settlement.plan.decision.value
    if taken_over:
        assert decision == "abort"  # the first's open Kafka transaction
        assert len(errors) == 1 and isinstance(errors[0], ProducerFencedError), errors
        assert env.records_in_order() == ["a-1"] and env.rows() == {"a-1"}  # rolled back on both sides
    else:
        assert not errors  # the first one's transaction committed normally
        if second_settles_first:
            assert decision == "commit" and first.fenced  # fenced during its Kafka commit, outcome read back
        else:
            assert decision == "nothing"
        assert env.records_in_order() == ["a-1", "a-2"]

    # The second instance fenced the first: its next transaction fails and changes nothing.
    with pytest.raises(ProducerFencedError):
        env.commit_one(first, "a-3")
    assert first.fenced
    env.commit_one(second, "b-1")
    with pytest.raises(ProducerFencedError):
        env.commit_one(first, "a-4")
    assert env.rows() == ({"a-1", "b-1"} if taken_over else {"a-1", "a-2", "b-1"})
    env.assert_consistent()
    first.close()
    second.close()
    second_engine.dispose()


@pytest.mark.parametrize("bind", ["connection", "session"])
@pytest.mark.parametrize("taker", ["writer", "cli"])
def test_a_takeover_after_the_prepare_is_caught_by_the_guarded_state_update(
    pg_env: Env, bind: str, taker: str
) -> None:
    """PostgreSQL's optimistic path, in the one window Kafka cannot report: the first writer has
    prepared, then another instance's recovery (or `kafka2pc recover`) aborts that prepared transaction
    and fences the producer.  Committing the database now would be a heuristic outcome; the guarded
    state update sees the row changed and rolls back both sides instead."""
    env = pg_env
    control = Hook()
    first = env.writer(on_step=control)
    first.recover()
    env.commit_one(first, "a-1")
    second = env.writer()
    took_over: list[Any] = []

    def take_over(step: Step) -> None:
        if step is Step.PREPARED and not took_over:
            if taker == "writer":
                took_over.append(second.recover().settlement.plan.decision.value)  # type: ignore[union-attr]
            else:
                proc = subprocess.run(
                    [str(Path(sys.executable).parent / "kafka2pc"), "--bootstrap-server", env.bootstrap, "--timeout", "60",
                     "recover", "--db-url", env.engine.url.render_as_string(hide_password=False),
                     "--transactional-id", first.transactional_id, "--output", "json"],
                    capture_output=True, text=True, timeout=120,
                )
                assert proc.returncode == 0, proc.stderr
                entries = json.loads(proc.stdout)["entries"]
                took_over.extend(e["decision"] for e in entries if e["transactional_id"] == first.transactional_id)

    control.fn = take_over
    with pytest.raises(ProducerFencedError, match="state row changed"):
        if bind == "connection":
            env.commit_one(first, "a-2")
        else:
            with Session(env.engine) as session, first.transaction(session) as tx:
                env.write(session, tx, "a-2")
    assert took_over == ["abort"]  # the taker aborted the prepared, not yet stored, transaction
    assert first.fenced
    assert env.rows() == {"a-1"} and env.records_in_order() == ["a-1"]  # nothing of a-2 on either side
    if taker == "writer":
        env.commit_one(second, "b-1")
    env.assert_consistent()
    first.close()
    second.close()


def test_a_second_instance_fails_early_on_the_lock_timeout(env: Env, db_url: str) -> None:
    """With a lock timeout (PostgreSQL: lock_timeout_s; SQLite: the driver's busy timeout) it does not wait.

    The second instance recovers while the first holds the state row's lock:
    between its state update and its COMMIT (on a Session whose commit() may
    write, where those are two round trips).
    """
    sqlite = db_url.startswith("sqlite")
    impatient_engine = sa.create_engine(db_url, connect_args={"timeout": 0.3} if sqlite else {})
    seen: dict[str, Any] = {}
    control = Hook()
    first = env.writer(on_step=control)
    first.recover()
    second = DualWriter(
        impatient_engine, {"bootstrap.servers": env.bootstrap, "transactional.id": first.transactional_id},
        state_table=env.states, lock_timeout_s=None if sqlite else 0.3,
    )

    def second_recovers(step: Step) -> None:
        if step is Step.DB_COMMITTING and "took" not in seen:
            started = time.monotonic()
            with pytest.raises(sa.exc.OperationalError, match="lock"):
                second.recover()
            seen["took"] = time.monotonic() - started
            seen["producer"] = second.producer

    control.fn = second_recovers
    with session_committing_apart(env.engine) as session, first.transaction(session) as tx:
        env.write(session, tx, "held")
    assert seen["took"] < 5
    assert seen["producer"] is None  # it stopped before creating a producer: nothing fenced
    assert env.records_in_order() == ["held"]  # the first instance was not disturbed
    env.assert_consistent()
    first.close()
    second.close()
    impatient_engine.dispose()


def test_a_writer_whose_state_row_was_changed_by_another_instance_stops(env: Env) -> None:
    """A writer taken over by another instance stops: Kafka fences it (PostgreSQL, where nothing is
    locked before the state update) or it sees a foreign state in the locked row first (SQLite)."""
    first, second = env.writer(), env.writer()
    first.recover()
    env.commit_one(first, "a-1")
    second.recover()
    env.commit_one(second, "b-1")
    with pytest.raises(ProducerFencedError, match="another instance|fenced"):
        env.commit_one(first, "a-2")
    assert env.rows() == {"a-1", "b-1"}
    env.assert_consistent()
    first.close()
    second.close()


# -- consume-transform-produce ------------------------------------------------------------------


def test_consume_transform_produce_is_exactly_once_across_crashes(
    db_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Input topic -> rows + output topic, offsets in the same 2PC transaction; children killed mid-way."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    env = Env(db_url, kafka_bootstrap)
    source = create_topic(kafka_bootstrap)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(40):
        producer.produce(source, value=f"{env.series}:in-{i}".encode(), key=str(i).encode())
    producer.flush(30)
    group = f"dw-ctp-{env.series}"
    job = {"mode": "ctp", "db_url": db_url, "bootstrap": kafka_bootstrap, "tid": f"dw-{env.series}",
           "topic": env.topic, "input": source, "input_count": 40, "group": group, "series": env.series,
           "results": str(tmp_path / "ctp.jsonl"), "batch": 4}
    zygote = Zygote(tmp_path / "zygote.log")
    try:
        for run, (point, batch) in enumerate(
            [("db_committed", 2), ("prepared", 1), ("db_committing", 2), ("kafka_committed", 0), ("state_stored", 1)]
        ):
            assert zygote.run({**job, "run": run, "point": point, "crash_txn": batch}) == -9, point
        assert zygote.run({**job, "run": 99}) == 0  # the last one runs to the end of the input
    finally:
        zygote.close()
    expected = {f"in-{i}" for i in range(40)}
    assert env.rows() == expected
    assert sorted(env.records_in_order()) == sorted(expected)  # each exactly once
    env.assert_consistent()
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group})
    committed = consumer.committed([TopicPartition(source, 0)], timeout=10)
    consumer.close()
    assert committed[0].offset == 40
    env.engine.dispose()


# -- the database connection dies during COMMIT ---------------------------------------------------


def test_postgres_backend_terminated_at_commit_aborts_kafka(pg_env: Env, pg_url: str) -> None:
    control = Hook()
    writer = pg_env.writer(on_step=control)
    writer.recover()
    pg_env.commit_one(writer, "before")
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    backend = {}

    def terminate(step: Step) -> None:
        if step is Step.DB_COMMITTING and "pid" in backend:
            with admin.connect() as conn:
                assert conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": backend["pid"]}).scalar()
                deadline = time.monotonic() + 30
                while conn.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"),
                                   {"p": backend["pid"]}).scalar() != 0:  # gone before the COMMIT is sent
                    assert time.monotonic() < deadline, "the terminated backend is still there after 30 s"
                    time.sleep(0.02)

    control.fn = terminate
    with pytest.raises(sa.exc.DBAPIError), pg_env.engine.connect() as conn, writer.transaction(conn) as tx:
        backend["pid"] = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()
        pg_env.write(conn, tx, "terminated")
    backend.clear()
    control.fn = None
    assert pg_env.rows() == {"before"}
    assert pg_env.records_in_order() == ["before"]  # the prepared Kafka transaction was aborted, not left open
    pg_env.assert_consistent()
    pg_env.commit_one(writer, "after")
    assert sorted(pg_env.records_in_order()) == ["after", "before"]
    writer.close()
    admin.dispose()


def test_the_state_function_carries_the_update_and_a_writer_without_it_updates_inline(
    pg_url: str, kafka_bootstrap: str
) -> None:
    """create_all makes the function; a table without it (migrations), or one dropped at run time, still works."""
    name = f"st_{uuid.uuid4().hex[:8]}"
    env = Env(pg_url, kafka_bootstrap, state_table=name)
    engine = env.engine
    function = f"kafka2pc_store_{name}"
    signature = f"{function}(text, text, text, text, timestamp)"

    def has_function() -> bool:
        with engine.connect() as conn:
            return bool(conn.execute(sa.text("SELECT to_regprocedure(:s) IS NOT NULL"), {"s": signature}).scalar())

    seen: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda _c, _cur, stmt, *_rest: seen.append(stmt))

    def combined() -> str:
        return next(s for s in reversed(seen) if s.rstrip().endswith("COMMIT"))

    assert has_function()
    writer = env.writer()
    writer.recover()
    env.commit_one(writer, "via-function")
    assert combined().startswith(f'SELECT "{function}"(')
    with engine.begin() as conn:  # dropped while the writer runs: that transaction rolls back, clearly
        conn.exec_driver_sql(f'DROP FUNCTION "{function}"(text, text, text, text, timestamp)')
    with pytest.raises(sa.exc.ProgrammingError, match="does not exist"):
        env.commit_one(writer, "lost-function")
    env.commit_one(writer, "inline")  # the next one updates inline
    assert "WITH u AS (UPDATE" in combined()
    writer.close()
    fresh = env.writer()  # a table made by a migration without the function: inline from the start
    fresh.recover()
    env.commit_one(fresh, "inline-again")
    assert "WITH u AS (UPDATE" in combined()
    fresh.create_tables()  # (re)creates the function of an existing table
    assert has_function()
    fresh.recover()  # the next claim finds it
    env.commit_one(fresh, "via-function-again")
    assert combined().startswith(f'SELECT "{function}"(')
    assert env.rows() == {"via-function", "inline", "inline-again", "via-function-again"}
    env.assert_consistent()
    fresh.close()
    env.metadata.drop_all(engine)  # drops the function with the table
    assert not has_function()
    engine.dispose()


def test_a_session_sends_the_state_with_the_commit_unless_its_commit_would_write_more(
    pg_url: str, kafka_bootstrap: str
) -> None:
    """A Session's state update goes with the COMMIT in one round trip; a before_commit listener (it may write)
    or a Session joined to a Connection's transaction keeps the update and the COMMIT apart."""
    env = Env(pg_url, kafka_bootstrap)
    seen: list[str] = []
    sa.event.listen(env.engine, "before_cursor_execute", lambda _c, _cur, stmt, *_rest: seen.append(stmt))
    writer = env.writer()
    writer.recover()

    def last_state_update() -> str:
        return next(s for s in reversed(seen) if "kafka2pc_store_" in s or "UPDATE kafka_transaction_state" in s)

    with Session(env.engine) as session, writer.transaction(session) as tx:
        env.write(session, tx, "alone")
    assert last_state_update().rstrip().endswith("COMMIT")

    written: list[str] = []

    def before_commit(session: Session) -> None:  # a hook that writes: inside the transaction, as before
        full = f"{env.series}:hooked-{len(written)}"
        written.append(full)
        session.execute(env.items.insert().values(id=full, series=env.series))

    with Session(env.engine) as session:
        sa.event.listen(session, "before_commit", before_commit)
        with writer.transaction(session) as tx:
            env.write(session, tx, "with-hook")
    assert not last_state_update().rstrip().endswith("COMMIT")
    with env.engine.connect() as conn:
        outer = conn.begin()
        with Session(bind=conn) as session, writer.transaction(session) as tx:  # joins conn's transaction
            env.write(session, tx, "joined")
        assert not last_state_update().rstrip().endswith("COMMIT")
        outer.commit()
    assert env.rows() == {"alone", "with-hook", "hooked-0", "joined"}
    writer.close()
    env.metadata.drop_all(env.engine)
    env.engine.dispose()


def test_the_state_function_refuses_a_changed_row_and_quotes_odd_names(pg_url: str) -> None:
    """The function's guard is the inline update's: another version of the row makes it raise, nothing is stored."""
    from kafka2pc.recipes.dual_write import state_function_sql

    engine = sa.create_engine(pg_url)
    metadata = sa.MetaData()
    odd = define_state_table(metadata, 'odd "name" ' + "x" * 39)  # 50 characters: the function's name is hashed
    with engine.begin() as conn:
        conn.exec_driver_sql('CREATE SCHEMA IF NOT EXISTS "k2pc schema"')
    other = define_state_table(metadata, "plain", schema="k2pc schema")
    metadata.create_all(engine)
    assert '"k2pc schema"."kafka2pc_store_plain"' in state_function_sql(other)
    with engine.begin() as conn:
        conn.execute(other.insert().values(transactional_id="t", prepared_txn_state=None))
        token = conn.execute(sa.text('SELECT xmin::text FROM "k2pc schema".plain')).scalar_one()
    call = sa.text('SELECT "k2pc schema".kafka2pc_store_plain(:tid, :state, :token, :last, now()::timestamp)')
    with engine.begin() as conn:
        new = conn.execute(call, {"tid": "t", "state": "s1", "token": token, "last": None}).scalar_one()
    with engine.begin() as conn:  # the old token (or the wrong last state) no longer matches
        for args in ({"token": token, "last": "s1"}, {"token": str(new), "last": None}):
            with pytest.raises(sa.exc.DataError, match="the state row changed"), conn.begin_nested():
                conn.execute(call, {"tid": "t", "state": "s2", **args})
        assert conn.execute(sa.select(other.c.prepared_txn_state)).scalar_one() == "s1"
    with engine.connect() as conn:
        names = set(conn.execute(sa.text("SELECT proname FROM pg_proc WHERE proname LIKE 'kafka2pc_store_%'")).scalars())
    assert "kafka2pc_store_plain" in names and any(len(n) <= 63 and n != "kafka2pc_store_plain" for n in names)
    metadata.drop_all(engine)
    assert odd.name.startswith("odd")
    engine.dispose()


@pytest.mark.parametrize("statement_listener", [False, True])
def test_a_dead_connection_at_the_combined_commit_is_reported_as_sqlalchemy_does(
    pg_env: Env, pg_url: str, statement_listener: bool
) -> None:
    """With or without a statement listener on the engine (SQLAlchemy's path or the direct one)."""
    seen: list[str] = []
    if statement_listener:
        sa.event.listen(pg_env.engine, "before_cursor_execute", lambda _c, _cur, stmt, *_rest: seen.append(stmt))
    control = Hook()
    writer = pg_env.writer(on_step=control)
    writer.recover()
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    backend: dict[str, int] = {}

    def terminate(step: Step) -> None:
        if step is Step.DB_COMMITTING and "pid" in backend:
            with admin.connect() as conn:
                conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": backend["pid"]})
                while conn.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"),
                                   {"p": backend["pid"]}).scalar():
                    time.sleep(0.02)

    control.fn = terminate
    with pg_env.engine.connect() as conn:
        with pytest.raises(sa.exc.DBAPIError) as raised, writer.transaction(conn) as tx:
            backend["pid"] = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
            pg_env.write(conn, tx, "dead")
        assert raised.value.connection_invalidated and conn.invalidated
    control.fn = None
    # The combined statement (the state function's call, or the inline update, then COMMIT) went
    # through SQLAlchemy, where the listener saw it, only when there is a listener.
    assert any(s.rstrip().endswith("COMMIT") and ("UPDATE" in s or "kafka2pc_store_" in s)
               for s in seen) is statement_listener
    assert pg_env.rows() == set() and pg_env.records_in_order() == []
    pg_env.commit_one(writer, "after")  # the pool hands out a live connection
    assert pg_env.records_in_order() == ["after"]
    pg_env.assert_consistent()
    writer.close()
    admin.dispose()


class CommitReplyDropper:
    """A TCP proxy to PostgreSQL that can swallow the reply to a COMMIT and cut the connection.

    The server really commits (the proxy waits for its answer) but the client
    never hears it: the "COMMIT sent, reply lost" case that no exception type
    can settle, only reading the database again can.
    """

    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.armed = threading.Event()
        self.refuse = threading.Event()
        self.dropped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refuse.is_set():
                client.close()
                continue
            server = socket.create_connection(self._upstream)
            swallow = threading.Event()
            threading.Thread(target=self._pump_up, args=(client, server, swallow), daemon=True).start()
            threading.Thread(target=self._pump_down, args=(server, client, swallow), daemon=True).start()

    def _pump_up(self, client: socket.socket, server: socket.socket, swallow: threading.Event) -> None:
        try:
            while data := client.recv(65536):
                # A simple-protocol query ending in COMMIT: "COMMIT" alone, or the recipe's
                # state update and COMMIT sent together.
                if self.armed.is_set() and data[:1] == b"Q" and data.endswith(b"COMMIT\x00"):
                    self.armed.clear()
                    swallow.set()
                server.sendall(data)
        except OSError:
            pass

    def _pump_down(self, server: socket.socket, client: socket.socket, swallow: threading.Event) -> None:
        try:
            while data := server.recv(65536):
                if swallow.is_set():  # the server's answer to COMMIT: committed, and never delivered
                    self.dropped.set()
                    break
                client.sendall(data)
        except OSError:
            pass
        for sock in (client, server):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self._listener.close()


@pytest.mark.parametrize("database_reachable_afterwards", [True, False])
def test_commit_reply_lost_is_settled_by_reading_the_state_back(
    pg_url: str, kafka_bootstrap: str, database_reachable_afterwards: bool
) -> None:
    real = sa.make_url(pg_url)
    proxy = CommitReplyDropper(real.host or "127.0.0.1", real.port or 5432)
    url = real.set(host="127.0.0.1", port=proxy.port, query={"sslmode": "disable"})
    env = Env(url.render_as_string(hide_password=False), kafka_bootstrap)
    env.engine.dispose()
    env.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    control = Hook()
    writer = env.writer(on_step=control)
    writer.recover()

    def on_step(step: Step) -> None:
        if step is Step.DB_COMMITTING:
            proxy.armed.set()
            if not database_reachable_afterwards:
                proxy.refuse.set()

    control.fn = on_step
    if database_reachable_afterwards:
        env.commit_one(writer, "committed-unheard")  # no exception: the state row says it committed
        assert proxy.dropped.is_set()
        assert writer.metrics().in_doubt_transactions == 0
    else:
        with pytest.raises(IndefiniteOutcomeError) as info:
            env.commit_one(writer, "committed-unheard")
        assert proxy.dropped.is_set()
        assert info.value.state is not None
        metrics = writer.metrics()
        assert metrics.in_doubt_transactions == 1 and metrics.oldest_open_transaction_age_s is not None
        assert env.records_in_order() == []  # prepared, held back: nothing guessed
        control.fn = None
        proxy.refuse.clear()
        result = writer.recover()  # the database is back: its state row decides
        assert result.settlement is not None and result.settlement.plan.decision.value == "commit"
        assert writer.metrics().in_doubt_transactions == 0
    control.fn = None
    assert env.records_in_order() == ["committed-unheard"]
    env.commit_one(writer, "next")
    env.assert_consistent()
    writer.close()
    env.engine.dispose()
    proxy.close()


# -- metrics, retained records ----------------------------------------------------------------


def test_metrics_snapshot_reports_the_open_transaction_age(env: Env) -> None:
    writer = env.writer()
    writer.recover()
    assert writer.metrics().oldest_open_transaction_age_s is None
    with env.engine.connect() as conn, writer.transaction(conn) as tx:
        env.write(conn, tx, "m-1")
        time.sleep(0.2)
        during = writer.metrics()
    after = writer.metrics()
    assert during.oldest_open_transaction_age_s is not None and during.oldest_open_transaction_age_s >= 0.2
    assert after.oldest_open_transaction_age_s is None
    assert (after.transactions_committed, after.in_doubt_transactions, after.recoveries) == (1, 0, 1)
    writer.close()


def test_retained_records_are_kept_until_kafka_commits_and_then_dropped(env: Env) -> None:
    writer = env.writer(retain_records=True)
    writer.recover()
    with env.engine.connect() as conn, writer.transaction(conn) as tx:
        env.write(conn, tx, "r-1")
        extra = f"{env.series}:with-headers"
        tx.produce(env.topic, value=extra, key=None, headers={"h": b"v"})
        conn.execute(env.items.insert().values(id=extra, series=env.series))

    def outbox_rows() -> list[Any]:
        with env.engine.connect() as conn:
            return conn.execute(
                sa.select(env.outbox).where(env.outbox.c.transactional_id == writer.transactional_id)
                .order_by(env.outbox.c.seq)
            ).all()

    rows = outbox_rows()
    prefix = env.series.encode() + b":"
    assert [(r.seq, r.record_value, r.kafka_partition) for r in rows] == [
        (0, prefix + b"r-1", 0), (1, prefix + b"with-headers", 0)
    ]
    assert rows[0].record_key == prefix + b"r-1" and rows[1].record_key is None
    assert rows[1].headers is not None and "h" in rows[1].headers
    assert rows[0].prepared_txn_state == str(tx.prepared_state)
    env.commit_one(writer, "r-2")  # the next transaction drops the spent copies and keeps its own
    assert [r.record_value for r in outbox_rows()] == [prefix + b"r-2"]
    assert writer.recover().republished == 0  # committed: nothing to re-publish, copies dropped
    assert outbox_rows() == []
    env.assert_consistent()
    writer.close()


def test_transaction_and_recover_refuse_nesting(env: Env) -> None:
    writer = env.writer()
    writer.recover()
    with pytest.raises(Kafka2pcError), env.engine.connect() as conn, writer.transaction(conn):
        writer.recover()
    env.commit_one(writer, "fine")
    env.assert_consistent()
    writer.close()
