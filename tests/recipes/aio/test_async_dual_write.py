"""The asyncio dual write (``kafka2pc.recipes.dual_write.aio``) in one process.

Real broker, real PostgreSQL (psycopg's async driver) and SQLite (aiosqlite):
the normal path on an ``AsyncSession`` and an ``AsyncConnection``, the steps,
rollback, recovery of a prepared transaction, the misuse guards, fencing,
cancellation, concurrent tasks on one writer, typed errors.  Process crashes
are in ``test_async_dual_write_crash.py``, the FastAPI service over HTTP in
``test_async_dual_write_http.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from harness.env import Env
from kafka2pc.recipes.dual_write import (
    DualWriter,
    MissingTableError,
    StateRowLockedError,
    Step,
    TransactionMisuseError,
    WriterState,
    define_state_table,
)
from kafka2pc.recipes.dual_write.aio import AsyncDualWriter, recover_all
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from kafka2pc import IllegalStateError, PreparedTxnState, ProducerFencedError, UnknownTopicError, UsageError
from kafka2pc.aio import AsyncTwoPhaseCommitProducer
from kafka2pc.testing import create_topic, drain, end_offsets

_T = TypeVar("_T")


class _Base(DeclarativeBase):
    pass


class Order(_Base):
    __tablename__ = "adw_orders"
    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    series: Mapped[str] = mapped_column(sa.String(64))


@pytest.fixture
def env(db_url: str, kafka_bootstrap: str) -> Iterator[Env]:
    e = Env(db_url, kafka_bootstrap, tid_prefix="adw")
    _Base.metadata.create_all(e.engine)
    yield e
    e.engine.dispose()


def run(scenario: Callable[[AsyncEngine], Awaitable[_T]], env: Env) -> _T:
    """Run ``scenario(async_engine)`` on a fresh loop; dispose of the engine afterwards."""

    async def main() -> _T:
        engine = env.async_engine()
        try:
            return await scenario(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def test_session_and_connection_commit_both_sides_through_the_same_steps(env: Env) -> None:
    steps: list[Step] = []
    statements: list[str] = []

    async def scenario(engine: AsyncEngine) -> PreparedTxnState | None:
        sa.event.listen(engine.sync_engine, "before_cursor_execute",
                        lambda conn, cursor, statement, *rest: statements.append(statement))
        writer = env.async_writer(engine, on_step=steps.append)
        first = await writer.recover()
        assert first.settlement is not None and first.settlement.plan.decision.value == "nothing"
        assert writer.state is WriterState.READY and isinstance(writer.producer, AsyncTwoPhaseCommitProducer)
        steps.clear()
        async with engine.connect() as conn:  # AsyncConnection, autobegun
            async with writer.transaction(conn) as tx:
                await env.write_async(conn, tx, "c-1")
            assert tx.prepared_state is not None and not tx.prepared_state.is_empty
        # PostgreSQL over psycopg's async driver takes the sync recipe's combined path: the guarded
        # state update (the state function's call, or the inline update when the table was made without
        # it) and the COMMIT in one round trip (simple query protocol).
        combined = [s for s in statements
                    if ("kafka2pc_store_" in s or "UPDATE" in s) and s.rstrip().endswith("COMMIT")]
        assert len(combined) == (1 if env.url.startswith("postgresql") else 0), statements
        connection_steps = list(steps)
        steps.clear()
        async with AsyncSession(engine) as session:  # ORM AsyncSession: flushed before the prepare
            async with writer.transaction(session) as tx:
                session.add(Order(id=f"{env.series}:o-1", series=env.series))
                await env.write_async(session, tx, "s-1")
                assert tx.records_produced == 1 and tx.transactional_id == writer.transactional_id
            assert await session.get(Order, f"{env.series}:o-1") is not None
        assert steps == connection_steps == [
            Step.DB_BEGUN, Step.KAFKA_BEGUN, Step.PRODUCED, Step.BODY_DONE, Step.PREPARED, Step.STATE_STORED,
            Step.DB_COMMITTING, Step.DB_COMMITTED, Step.KAFKA_COMMITTED,
        ]
        assert writer.metrics().transactions_committed == 2
        await writer.close()
        assert writer.state is WriterState.CLOSED
        return tx.prepared_state

    last = run(scenario, env)
    with env.engine.connect() as conn:
        stored = conn.execute(sa.select(env.states).where(env.states.c.transactional_id == f"adw-{env.series}")).one()
    assert PreparedTxnState(stored.prepared_txn_state) == last  # the state table format of the sync recipe
    assert env.records() == ["c-1", "s-1"]
    env.assert_consistent()


def test_an_exception_before_the_database_commit_rolls_back_both(env: Env) -> None:
    failing: list[Step | None] = [None]

    def hook(step: Step) -> None:
        if step is failing[0]:
            raise RuntimeError(f"injected at {step.value}")

    async def scenario(engine: AsyncEngine) -> None:
        writer = env.async_writer(engine, on_step=hook)
        await writer.recover()
        await env.commit_one_async(engine, writer, "kept")
        for step in (None, Step.PREPARED, Step.STATE_STORED, Step.DB_COMMITTING):
            failing[0] = step
            with pytest.raises(RuntimeError):
                async with AsyncSession(engine) as session, writer.transaction(session) as tx:
                    await env.write_async(session, tx, f"lost-{step}")
                    if step is None:
                        raise RuntimeError("application error")
        failing[0] = None
        await env.commit_one_async(engine, writer, "kept-2")  # the writer goes on
        assert writer.metrics().transactions_rolled_back == 4
        await writer.close()

    run(scenario, env)
    assert env.rows() == {"kept", "kept-2"}
    assert env.records() == ["kept", "kept-2"]
    env.assert_consistent()


def test_recovery_commits_a_transaction_left_prepared_after_the_database_commit(env: Env) -> None:
    """Stopped between the two commits; a sync DualWriter and an async one recover each other's transactions."""

    class Stop(BaseException):
        pass

    def stop_after_db_commit(step: Step) -> None:
        if step is Step.DB_COMMITTED:
            raise Stop

    async def leave_prepared(engine: AsyncEngine) -> None:
        writer = env.async_writer(engine, on_step=stop_after_db_commit)
        await writer.recover()
        with pytest.raises(Stop):
            await env.commit_one_async(engine, writer, "in-doubt")
        await writer.close()

    run(leave_prepared, env)
    assert env.rows() == {"in-doubt"} and env.records() == []  # the database committed, Kafka not yet
    assert end_offsets(env.bootstrap, env.topic, "read_committed") != end_offsets(env.bootstrap, env.topic)

    async def recover_async(engine: AsyncEngine) -> None:
        writer = env.async_writer(engine)
        result = await writer.recover()
        assert result.settlement is not None and result.settlement.plan.decision.value == "commit"
        again = await writer.recover()  # idempotent
        assert again.settlement is not None and again.settlement.plan.decision.value == "nothing"
        await env.commit_one_async(engine, writer, "after")
        await writer.close()

    run(recover_async, env)
    assert env.records() == ["after", "in-doubt"]

    # The other way round: the sync recipe leaves it, the async writer settles it.
    sync_writer = DualWriter(env.engine, {"bootstrap.servers": env.bootstrap, "transactional.id": f"adw-{env.series}"},
                             state_table=env.states, on_step=stop_after_db_commit)
    with pytest.raises(Stop), env.engine.connect() as conn, sync_writer.transaction(conn) as sync_tx:
        full = f"{env.series}:sync"
        conn.execute(env.items.insert().values(id=full, series=env.series))
        sync_tx.produce(env.topic, value=full.encode())
    sync_writer.close()

    async def recover_sync_leftover(engine: AsyncEngine) -> None:
        writer = env.async_writer(engine)
        result = await writer.recover()
        assert result.settlement is not None and result.settlement.plan.decision.value == "commit"
        await writer.close()

    run(recover_sync_leftover, env)
    assert env.records() == ["after", "in-doubt", "sync"]
    env.assert_consistent()


@pytest.mark.parametrize("misuse", ["commit", "rollback", "close"])
@pytest.mark.parametrize("bind_kind", ["connection", "session"])
def test_ending_the_bound_transaction_in_the_block_fails_and_keeps_neither_side(
    env: Env, bind_kind: str, misuse: str
) -> None:
    async def scenario(engine: AsyncEngine) -> None:
        writer = env.async_writer(engine)
        await writer.recover()
        await env.commit_one_async(engine, writer, "before")
        seen: list[BaseException] = []
        with pytest.raises(TransactionMisuseError, match="inside `with writer.transaction"):
            async with (AsyncSession(engine) if bind_kind == "session" else engine.connect()) as bind:
                async with writer.transaction(bind) as tx:
                    await env.write_async(bind, tx, "misused")
                    try:
                        await getattr(bind, misuse)()
                    except TransactionMisuseError as exc:
                        seen.append(exc)
                        raise
        if misuse == "commit":
            assert len(seen) == 1  # the commit itself was refused
        assert engine.pool.checkedout() == 0  # the interrupted rollback or close leaked no connection
        await env.commit_one_async(engine, writer, "after")  # the writer goes on
        await writer.close()

    run(scenario, env)
    assert env.rows() == {"before", "after"} and env.records() == ["after", "before"]
    env.assert_consistent()


def test_wrong_arguments_and_nesting_are_refused(env: Env) -> None:
    with pytest.raises(UsageError, match="AsyncEngine"):
        AsyncDualWriter(env.engine, {"bootstrap.servers": env.bootstrap, "transactional.id": "x"})  # type: ignore[arg-type]

    async def scenario(engine: AsyncEngine) -> None:
        with pytest.raises(UsageError, match="transactional.id"):
            AsyncDualWriter(engine, {"bootstrap.servers": env.bootstrap})
        writer = env.async_writer(engine)
        await writer.recover()
        with pytest.raises(UsageError, match="AsyncSession or an AsyncConnection"), Session(env.engine) as session:
            async with writer.transaction(session):  # type: ignore[arg-type]
                pass
        async with engine.connect() as conn:
            with pytest.raises(IllegalStateError, match="cannot be nested"):
                async with writer.transaction(conn) as tx:
                    await env.write_async(conn, tx, "nested")
                    await writer.recover()
        await env.commit_one_async(engine, writer, "fine")
        await writer.close()

    run(scenario, env)
    assert env.rows() == {"fine"} and env.records() == ["fine"]


def test_concurrent_tasks_share_one_writer_one_transaction_at_a_time(env: Env) -> None:
    async def scenario(engine: AsyncEngine) -> int:
        writer = env.async_writer(engine)
        await writer.recover()
        open_now, most = 0, 0

        async def request(i: int) -> None:
            nonlocal open_now, most
            async with AsyncSession(engine) as session, writer.transaction(session) as tx:
                open_now += 1
                most = max(most, open_now)
                session.add(Order(id=f"{env.series}:task-{i}", series=env.series))
                await env.write_async(session, tx, f"task-{i}")
                await asyncio.sleep(0)
                open_now -= 1

        await asyncio.gather(*(request(i) for i in range(40)))
        assert writer.metrics().transactions_committed == 40
        await writer.close()
        return most

    assert run(scenario, env) == 1
    assert env.rows() == {f"task-{i}" for i in range(40)}
    env.assert_consistent()


def test_a_cancelled_task_does_not_interrupt_the_commit(env: Env) -> None:
    """The request's task is cancelled while the writer commits: the commit finishes, then CancelledError."""
    holder: dict[str, asyncio.Task[Any]] = {}

    def cancel_at_db_committing(step: Step) -> None:
        if step is Step.DB_COMMITTING and "task" in holder:
            holder.pop("task").cancel()

    async def scenario(engine: AsyncEngine) -> None:
        writer = env.async_writer(engine, on_step=cancel_at_db_committing)
        await writer.recover()

        async def request() -> None:
            await env.commit_one_async(engine, writer, "cancelled-while-committing")

        task = asyncio.ensure_future(request())
        holder["task"] = task
        with pytest.raises(asyncio.CancelledError):
            await task
        assert writer.state is WriterState.READY and writer.metrics().transactions_committed == 1
        await env.commit_one_async(engine, writer, "next")  # no recovery needed
        assert writer.metrics().recoveries == 1
        await writer.close()

    run(scenario, env)
    assert env.rows() == {"cancelled-while-committing", "next"}
    assert env.records() == ["cancelled-while-committing", "next"]
    env.assert_consistent()


def test_a_writer_taken_over_by_another_instance_stops_with_producer_fenced(env: Env) -> None:
    async def scenario(engine: AsyncEngine) -> None:
        first = env.async_writer(engine)
        await first.recover()
        await env.commit_one_async(engine, first, "first")
        second = env.async_writer(engine)
        await second.recover()  # takes the transactional id over
        with pytest.raises(ProducerFencedError):
            await env.commit_one_async(engine, first, "zombie")
        assert first.fenced
        with pytest.raises(ProducerFencedError):  # stays fenced until an explicit recover()
            await env.commit_one_async(engine, first, "zombie-2")
        await env.commit_one_async(engine, second, "second")
        await first.close()
        await second.close()

    run(scenario, env)
    assert env.rows() == {"first", "second"} and env.records() == ["first", "second"]
    env.assert_consistent()


def test_missing_table_missing_topic_and_a_locked_state_row_are_typed_errors(env: Env) -> None:
    async def scenario(engine: AsyncEngine) -> None:
        missing = AsyncDualWriter(engine, {"bootstrap.servers": env.bootstrap, "transactional.id": "adw-missing"},
                                  state_table=define_state_table(sa.MetaData(), f"no_such_{env.series}"))
        with pytest.raises(MissingTableError, match="does not exist"):
            await missing.recover()
        await missing.close()

        writer = env.async_writer(engine, lock_timeout_s=0.5)
        await writer.recover()
        started = time.monotonic()
        with pytest.raises(UnknownTopicError, match="no-such-topic"):
            async with engine.connect() as conn, writer.transaction(conn) as tx:
                await tx.produce(f"no-such-topic-{env.series}", value=b"x")
        assert time.monotonic() - started < 15

        if env.url.startswith("postgresql"):
            # Another instance holds the state row's lock: recover() fails typed, in bounded time.
            with env.engine.connect() as holder:
                holder.execute(sa.select(env.states).where(env.states.c.transactional_id == writer.transactional_id)
                               .with_for_update())
                started = time.monotonic()
                with pytest.raises(StateRowLockedError):
                    await writer.recover()
                assert time.monotonic() - started < 5
                holder.rollback()
            await writer.recover()
        await env.commit_one_async(engine, writer, "ok")
        await writer.close()

    run(scenario, env)
    assert env.rows() == {"ok"} and env.records() == ["ok"]


def test_retained_records_keep_their_partition_and_recover_all_settles_many_ids(env: Env) -> None:
    class Stop(BaseException):
        pass

    def stop(step: Step) -> None:
        if step is Step.DB_COMMITTED:
            raise Stop

    topic = create_topic(env.bootstrap, partitions=3)

    async def scenario(engine: AsyncEngine) -> dict[str, str]:
        tids = [f"adw-{env.series}-shard-{i}" for i in range(3)]
        for i, tid in enumerate(tids):
            writer = env.async_writer(engine, tid, on_step=stop if i != 1 else None, retain_records=True)
            await writer.recover()
            try:
                async with engine.connect() as conn, writer.transaction(conn) as tx:
                    await conn.execute(env.items.insert().values(id=f"{env.series}:shard-{i}", series=env.series))
                    await tx.produce(topic, value=f"{env.series}:shard-{i}".encode(), key=f"k{i}".encode())
            except Stop:
                pass
            await writer.close()
        async with engine.connect() as conn:
            kept = (await conn.execute(sa.select(env.outbox.c.transactional_id, env.outbox.c.kafka_partition)
                                       .where(env.outbox.c.transactional_id.in_(tids)))).all()
        # Every retained record knows the partition it was delivered to (for a re-publication).
        assert len(kept) == 3 and all(p is not None for _, p in kept)
        writers = [env.async_writer(engine, tid, retain_records=True) for tid in tids]
        results = await recover_all(writers)
        for w in writers:
            await w.close()
        assert all(r.error is None and not r.heuristic for r in results.values())
        return {tid: results[tid].settlement.plan.decision.value for tid in tids}  # type: ignore[union-attr]

    decisions = run(scenario, env)
    assert list(decisions.values()) == ["commit", "nothing", "commit"]
    values = sorted(r.value.decode() for r in drain(env.bootstrap, topic) if r.value)
    assert values == sorted(f"{env.series}:shard-{i}" for i in range(3))



def test_without_greenlet_the_import_names_the_aio_extra() -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['greenlet'] = None\n"
            "try:\n    import kafka2pc.recipes.dual_write.aio\n"
            "except ImportError as exc:\n    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("MissingExtraError") and "pip install 'kafka2pc[aio]'" in out.stdout, out.stdout
