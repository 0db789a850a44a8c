"""Misuse and operator paths of the dual-write recipe (issue 11): the application ending the bound
transaction inside the block, lock contention in recover(), heuristic acknowledgement, malformed
states, the outbox after a failed transaction.  Real broker, PostgreSQL, SQLite and MariaDB."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from harness.env import Env, session_committing_apart
from kafka2pc.recipes.dual_write import (
    DualWriter,
    StateRowLockedError,
    Step,
    TransactionMisuseError,
    WriterState,
    define_outbox_table,
    define_state_table,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from kafka2pc import InvalidPreparedStateError, Kafka2pcError, ProducerFencedError, TransactionalIdMismatchError


@pytest.fixture
def env(any_db_url: str, kafka_bootstrap: str) -> Iterator[Env]:
    e = Env(any_db_url, kafka_bootstrap)
    yield e
    e.engine.dispose()


# -- the application ends the bound transaction inside the block ----------------------------------

MISUSES = ["commit", "rollback", "close"]


@pytest.mark.parametrize("bind_kind", ["connection", "session"])
@pytest.mark.parametrize("misuse", MISUSES)
def test_ending_the_bound_transaction_in_the_block_fails_loudly_and_keeps_neither_side(
    env: Env, bind_kind: str, misuse: str
) -> None:
    writer = env.writer()
    writer.recover()
    with env.engine.connect() as conn, writer.transaction(conn) as tx:
        env.write(conn, tx, "before")
    seen: list[BaseException] = []
    with pytest.raises(TransactionMisuseError, match="inside `with writer.transaction"):
        with (Session(env.engine) if bind_kind == "session" else env.engine.connect()) as bind:
            with writer.transaction(bind) as tx:
                env.write(bind, tx, "misused")
                try:
                    getattr(bind, misuse)()
                except TransactionMisuseError as exc:  # raised right there, and again at the block's exit
                    seen.append(exc)
                    raise
    if misuse == "commit":
        assert len(seen) == 1  # the commit itself was refused
    assert env.rows() == {"before"} and env.records() == ["before"]  # neither side kept "misused"
    with env.engine.connect() as conn, writer.transaction(conn) as tx:  # the writer goes on
        env.write(conn, tx, "after")
    assert env.rows() == {"before", "after"}
    env.assert_consistent()
    writer.close()


@pytest.mark.parametrize("misuse", ["commit", "rollback"])
def test_a_swallowed_misuse_still_fails_the_block(env: Env, misuse: str) -> None:
    """The application catches the error of its commit()/rollback() and goes on: the exit still fails."""
    writer = env.writer()
    writer.recover()
    with pytest.raises(TransactionMisuseError), Session(env.engine) as session:
        with writer.transaction(session) as tx:
            env.write(session, tx, "swallowed")
            try:
                getattr(session, misuse)()
            except Kafka2pcError:
                pass
            if misuse == "rollback":  # and writes again, in a transaction the recipe did not begin
                env.write(session, tx, "again")
    assert env.rows() == set() and env.records() == []
    env.assert_consistent()
    writer.close()


def test_savepoints_in_the_block_keep_working(env: Env) -> None:
    writer = env.writer()
    writer.recover()
    with Session(env.engine) as session, writer.transaction(session) as tx:
        env.write(session, tx, "outer")
        nested = session.begin_nested()
        session.execute(env.items.insert().values(id=f"{env.series}:undone", series=env.series))
        nested.rollback()
        with session.begin_nested():
            session.execute(env.items.insert().values(id=f"{env.series}:kept", series=env.series))
    with env.engine.connect() as conn, writer.transaction(conn) as tx:
        env.write(conn, tx, "core")
        with conn.begin_nested() as sp:
            conn.execute(env.items.insert().values(id=f"{env.series}:core-undone", series=env.series))
            sp.rollback()
    assert env.rows() == {"outer", "kept", "core"}
    assert env.records() == ["core", "outer"]
    writer.close()


def test_a_failed_flush_reports_its_own_error(env: Env) -> None:
    """SQLAlchemy's own rollback after a failed flush is not taken for a misuse."""
    writer = env.writer()
    writer.recover()
    with Session(env.engine) as session, writer.transaction(session) as tx:
        env.write(session, tx, "dup")
    with pytest.raises(sa.exc.IntegrityError), Session(env.engine) as session:
        with writer.transaction(session) as tx:
            env.write(session, tx, "dup")  # duplicate primary key
    assert env.rows() == {"dup"} and env.records() == ["dup"]
    writer.close()


class _Base(DeclarativeBase):
    pass


class _Item(_Base):
    __tablename__ = "dw_items"
    id: Mapped[str] = mapped_column(sa.String(100), primary_key=True)
    series: Mapped[str] = mapped_column(sa.String(64))


def test_a_failed_orm_flush_reports_its_own_error_and_keeps_neither_side(env: Env) -> None:
    """The recipe's flush (or an autoflush) fails: SQLAlchemy rolls the Session back itself, the
    flush's IntegrityError propagates (not a misuse error), and both sides are rolled back."""
    writer = env.writer()
    writer.recover()
    with Session(env.engine) as session, writer.transaction(session) as tx:
        env.write(session, tx, "dup")
    with pytest.raises(sa.exc.IntegrityError), Session(env.engine) as session:
        with writer.transaction(session) as tx:
            session.add(_Item(id=f"{env.series}:dup", series=env.series))  # flushed at the block's end
            tx.produce(env.topic, value=b"orphan")
    assert env.rows() == {"dup"} and env.records() == ["dup"]
    with env.engine.connect() as conn, writer.transaction(conn) as tx:
        env.write(conn, tx, "after")
    env.assert_consistent()
    writer.close()


def test_a_rollback_swallowed_in_an_except_block_still_fails_the_block(env: Env) -> None:
    writer = env.writer()
    writer.recover()
    with pytest.raises(TransactionMisuseError), Session(env.engine) as session:
        with writer.transaction(session) as tx:
            env.write(session, tx, "first")
            try:
                raise ValueError("application error")
            except ValueError:
                session.rollback()  # during exception handling: let through, remembered
            env.write(session, tx, "second")  # in a transaction the recipe did not begin
    assert env.rows() == set() and env.records() == []
    writer.close()


# -- retain_records: one failure does not break the writer --------------------------------------


@pytest.mark.parametrize("failing_step", [None, Step.PREPARED, Step.STATE_STORED])
def test_retain_records_writer_survives_a_failed_transaction(env: Env, failing_step: Step | None) -> None:
    state: dict[str, Any] = {"fail": None}

    def hook(step: Step) -> None:
        if step is state["fail"]:
            raise RuntimeError(f"injected at {step.value}")

    writer = env.writer(retain_records=True, on_step=hook)
    writer.recover()
    with env.engine.connect() as conn, writer.transaction(conn) as tx:
        env.write(conn, tx, "r-1")
    state["fail"] = failing_step
    with pytest.raises(RuntimeError), env.engine.connect() as conn, writer.transaction(conn) as tx:
        env.write(conn, tx, "lost")
        if failing_step is None:
            raise RuntimeError("application error")
    state["fail"] = None
    for i in range(2, 4):  # no duplicate (transactional_id, seq) in the outbox
        with env.engine.connect() as conn, writer.transaction(conn) as tx:
            env.write(conn, tx, f"r-{i}")
    assert env.rows() == {"r-1", "r-2", "r-3"}
    env.assert_consistent()
    writer.close()


# -- recover(): lock contention, heuristic acknowledgement, malformed states ----------------------


def test_lock_contention_in_recover_is_a_typed_error(env: Env, any_db_url: str) -> None:
    sqlite = any_db_url.startswith("sqlite")
    impatient = sa.create_engine(any_db_url, connect_args={"timeout": 0.3} if sqlite else {})
    paused, release = threading.Event(), threading.Event()

    def hold(step: Step) -> None:
        if step is Step.DB_COMMITTING:
            paused.set()
            release.wait(20)

    first = env.writer(on_step=hold)
    first.recover()
    second = DualWriter(impatient, {"bootstrap.servers": env.bootstrap, "transactional.id": first.transactional_id},
                        state_table=env.states, lock_timeout_s=None if sqlite else 0.3)

    def first_writes() -> None:  # held between its state update and its COMMIT (two round trips)
        with session_committing_apart(env.engine) as session, first.transaction(session) as tx:
            env.write(session, tx, "held")

    holder = threading.Thread(target=first_writes)
    holder.start()
    assert paused.wait(20)
    started = time.monotonic()
    try:
        with pytest.raises(StateRowLockedError) as info:
            second.recover()
    finally:
        release.set()
        holder.join(60)
    assert time.monotonic() - started < 5
    assert isinstance(info.value, Kafka2pcError) and isinstance(info.value, sa.exc.OperationalError)
    assert info.value.transactional_id == first.transactional_id and first.transactional_id in str(info.value)
    assert second.producer is None  # nothing fenced, nothing changed
    assert env.records() == ["held"]
    env.assert_consistent()
    first.close()
    second.close()
    impatient.dispose()


@pytest.mark.parametrize("stored", ["malformed", "another id's"])
def test_recover_refuses_a_bad_stored_state_and_changes_nothing(env: Env, stored: str) -> None:
    """A malformed state, or a valid one written under another transactional id, is refused before the
    claim commits: the row is exactly as it was (no version bump that would fence a live writer)."""
    writer = env.writer()
    writer.recover()
    value = "not-a-state"
    if stored == "another id's":
        other = env.writer(f"dw-other-{env.series}")
        with env.engine.connect() as conn, other.transaction(conn) as tx:
            env.write(conn, tx, "other-1")
        other.close()
        with env.engine.connect() as conn:
            value = conn.execute(sa.select(env.states.c.prepared_txn_state)
                                 .where(env.states.c.transactional_id == other.transactional_id)).scalar_one()
    where = env.states.c.transactional_id == writer.transactional_id
    with env.engine.begin() as conn:
        conn.execute(sa.update(env.states).where(where).values(prepared_txn_state=value))
    with env.engine.connect() as conn:
        before = conn.execute(sa.select(env.states).where(where)).one()
    error = InvalidPreparedStateError if stored == "malformed" else TransactionalIdMismatchError
    with pytest.raises(error, match=writer.transactional_id if stored == "malformed" else "another"):
        writer.recover()
    with env.engine.connect() as conn:
        assert conn.execute(sa.select(env.states).where(where)).one() == before
    assert writer.producer is None  # no producer made: nothing fenced in Kafka either
    writer.close()
    with env.engine.begin() as conn:  # an operator's repair; the database is shared by the session's tests
        conn.execute(sa.delete(env.states).where(where))


def test_a_writer_taken_over_between_transactions_sees_producer_fenced(env: Env) -> None:
    """Whatever the timing, a taken-over writer's next transaction fails with ProducerFencedError."""
    first, second = env.writer(), env.writer()
    first.recover()
    with env.engine.connect() as conn, first.transaction(conn) as tx:
        env.write(conn, tx, "a-1")
    second.recover()
    with pytest.raises(ProducerFencedError), env.engine.connect() as conn, first.transaction(conn) as tx:
        env.write(conn, tx, "a-2")
    assert first.state is WriterState.FENCED
    with env.engine.connect() as conn, second.transaction(conn) as tx:
        env.write(conn, tx, "b-1")
    assert env.rows() == {"a-1", "b-1"}
    env.assert_consistent()
    first.close()
    second.close()


def test_a_heuristic_outcome_can_be_acknowledged_once_and_later_recoveries_start_clean(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """Kafka aborted (transaction.timeout.ms) a transaction the database committed: every recovery
    reports it until it is acknowledged; acknowledging logs its details and clears the stored state."""
    from test_dual_write_crash import _wait_until_not_ongoing

    from kafka2pc import HeuristicOutcomeError

    class Stop(BaseException):
        pass

    def stop_after_db_commit(step: Step) -> None:
        if step is Step.DB_COMMITTED:
            raise Stop

    tid = f"dw-h-{env.series}"
    first = DualWriter(env.engine, {"bootstrap.servers": env.bootstrap, "transactional.id": tid,
                                    "transaction.timeout.ms": 5000},
                       state_table=env.states, on_step=stop_after_db_commit)
    first.recover()
    with pytest.raises(Stop), env.engine.connect() as conn, first.transaction(conn) as tx:
        env.write(conn, tx, "heuristic")
    _wait_until_not_ongoing(env.bootstrap, [tid])
    writer = env.writer(tid)
    for _ in range(2):  # reported by every recovery, until acknowledged
        with pytest.raises(HeuristicOutcomeError):
            writer.recover()
    with caplog.at_level("ERROR"):
        result = writer.recover(on_heuristic="acknowledge")
    assert result.heuristic and result.acknowledged
    assert any("ACKNOWLEDGED" in r.getMessage() and tid in r.getMessage() for r in caplog.records)
    clean = writer.recover()
    assert not clean.heuristic and clean.stored_state.is_empty
    with env.engine.connect() as conn, writer.transaction(conn) as tx:
        env.write(conn, tx, "after")
    assert env.rows() == {"heuristic", "after"} and env.records() == ["after"]
    first.close()
    writer.close()


# -- a newcomer's mistakes: no state table, no topic ---------------------------------------------


def test_a_missing_state_table_is_a_clear_error_saying_how_to_create_it(env: Env) -> None:
    from kafka2pc.recipes.dual_write import MissingTableError

    name = f"missing_{env.series}"
    writer = DualWriter(env.engine, {"bootstrap.servers": env.bootstrap, "transactional.id": f"dw-{env.series}"},
                        state_table=define_state_table(sa.MetaData(), name))
    started = time.monotonic()
    with pytest.raises(MissingTableError, match=f"{name}.*create_all"):
        writer.recover()
    assert time.monotonic() - started < 10
    retaining = DualWriter(env.engine, {"bootstrap.servers": env.bootstrap, "transactional.id": f"dw-o-{env.series}"},
                           state_table=env.states, outbox_table=define_outbox_table(sa.MetaData(), f"outbox_{name}"),
                           retain_records=True)
    with pytest.raises(MissingTableError, match=f"outbox_{name}"):
        retaining.recover()
    writer.close()
    retaining.close()


def test_producing_to_a_missing_topic_fails_fast_naming_the_topic(env: Env) -> None:
    from kafka2pc import UnknownTopicError

    writer = env.writer()
    writer.recover()
    missing = f"no-such-topic-{env.series}"
    started = time.monotonic()
    with pytest.raises(UnknownTopicError, match=missing) as info:
        with env.engine.connect() as conn, writer.transaction(conn) as tx:
            env.write(conn, tx, "orphan")
            tx.produce(missing, value=b"x")
    assert time.monotonic() - started < 15
    assert info.value.topic == missing
    assert env.rows() == set() and env.records() == []
    with env.engine.connect() as conn, writer.transaction(conn) as tx:  # the writer goes on
        env.write(conn, tx, "fine")
    env.assert_consistent()
    writer.close()


# -- a producer call failing oddly (librdkafka's binding: "flush returned NULL without setting an exception")


def _fail_prepare_with_system_error(writer: DualWriter) -> None:
    """Fault injection on the real producer: its prepare fails the way confluent-kafka's flush sometimes
    does on a fenced producer (a bare SystemError)."""
    producer = writer.producer
    assert producer is not None

    def broken(timeout: float | None = None) -> Any:
        raise SystemError("<method 'flush' of 'cimpl.Producer' objects> returned NULL without setting an exception")

    producer.prepare_transaction = broken  # type: ignore[method-assign]


def test_an_odd_producer_failure_of_a_taken_over_writer_is_producer_fenced(env: Env) -> None:
    from kafka2pc import FatalError

    first, second = env.writer(), env.writer()
    first.recover()
    with env.engine.connect() as conn, first.transaction(conn) as tx:
        env.write(conn, tx, "a-1")
    _fail_prepare_with_system_error(first)
    with pytest.raises(FatalError, match="SystemError"), env.engine.connect() as conn, first.transaction(conn) as tx:
        env.write(conn, tx, "not-taken-over")  # not taken over: a FatalError, not a raw SystemError
    assert first.state in (WriterState.READY, WriterState.NEEDS_RECOVERY)  # rolled back on both sides
    assert env.rows() == {"a-1"}
    first.recover()  # a new producer
    _fail_prepare_with_system_error(first)
    second.recover()  # takes over
    with pytest.raises(ProducerFencedError), env.engine.connect() as conn, first.transaction(conn) as tx:
        env.write(conn, tx, "a-2")
    assert first.fenced
    with env.engine.connect() as conn, second.transaction(conn) as tx:
        env.write(conn, tx, "b-1")
    assert env.rows() == {"a-1", "b-1"}
    env.assert_consistent()
    first.close()
    second.close()


def test_issue_11_recovery_failing_on_the_outbox_lock_after_settling_kafka_loses_nothing(env: Env) -> None:
    """retain_records, B's lock_timeout_s=2.0: B's outbox DELETE waits on A's open transaction (A is
    paused after its prepare) and times out after B aborted A's Kafka transaction.  A must not commit its
    database side when it resumes: its token is void since B's claim committed, before Kafka."""
    paused, release = threading.Event(), threading.Event()
    armed = {"on": False}

    def pause(step: Step) -> None:
        if armed["on"] and step is Step.PREPARED:
            paused.set()
            release.wait(30)

    first = env.writer(retain_records=True, on_step=pause)
    first.recover()
    for rid in ("a-1", "a-2"):  # the outbox holds a-2's copies: A's next transaction deletes them first
        with env.engine.connect() as conn, first.transaction(conn) as tx:
            env.write(conn, tx, rid)
    armed["on"] = True
    errors: list[BaseException] = []

    def first_writes() -> None:
        try:
            with Session(env.engine) as session, first.transaction(session) as tx:
                env.write(session, tx, "a-3")
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    holder = threading.Thread(target=first_writes)
    holder.start()
    assert paused.wait(30)
    second = env.writer(retain_records=True, lock_timeout_s=2.0)
    outcome: Any = None
    try:
        second.recover()
    except StateRowLockedError as exc:  # PostgreSQL/MariaDB: the outbox rows A deleted are locked
        outcome = exc
    finally:
        release.set()
        holder.join(60)
    if env.engine.dialect.name != "postgresql":
        # SQLite, MariaDB: A holds the state row's lock from its first statement: B changed nothing.
        assert isinstance(outcome, StateRowLockedError) and "claim the state row" in str(outcome)
        assert not errors and env.rows() == {"a-1", "a-2", "a-3"}
    else:
        assert isinstance(outcome, StateRowLockedError) and "outbox" in str(outcome)
        assert len(errors) == 1 and isinstance(errors[0], ProducerFencedError), errors
        assert env.rows() == {"a-1", "a-2"}  # A's database side rolled back: Kafka aborted it
    second.recover()
    with env.engine.connect() as conn, second.transaction(conn) as tx:
        env.write(conn, tx, "b-1")
    env.assert_consistent()
    first.close()
    second.close()
