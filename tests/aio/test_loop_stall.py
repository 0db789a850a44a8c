"""No kafka2pc.aio call blocks the event loop: measured as the loop sees it, broker healthy and broker stopped.

:class:`kafka2pc.aio.LoopStallMonitor` runs a 1 ms ticker and records how late
each tick wakes: the loop's stalls, whatever caused them (a blocking call, the
GIL held by another thread, or the loop's thread waiting for a CPU).  The
tests assert what the library controls, with ``harness.loop.assert_loop_not_blocked``:
no callback over ``STALL_BOUND_S`` (100 ms by default) and late ticks and
stalled time, each net of the loop thread's wait for a CPU; they print the real
figures (p50/p99/max, ticks over 10 ms).  With a healthy local broker a
blocking call would cost a round trip (about a millisecond), below the
machine's noise: the discriminating run is the one with the broker stopped,
where calls wait seconds.  The first test shows the monitor catches a
blocking call.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from harness.loop import MeasuredLoop, assert_loop_not_blocked, run
from harness.ports import closed_port, private_broker

from kafka2pc import (
    BrokerUnavailableError,
    IndefiniteOutcomeError,
    Kafka2pcError,
    RetriableError,
    TransactionAdmin,
    TxnState,
)
from kafka2pc.aio import AsyncTransactionAdmin, AsyncTwoPhaseCommitProducer, LoopStallMonitor, StallReport
from kafka2pc.testing import create_topic, drain
from kafka2pc.testing.broker import LocalKafka

# The loop's lateness is measured (net of its thread's wait for a CPU; a busy machine still slows the run).
pytestmark = pytest.mark.quiet


STALLED_FRACTION_BOUND = 0.25


def test_the_monitor_catches_a_blocking_call(kafka_bootstrap: str) -> None:
    async def main() -> tuple[StallReport, StallReport, float]:
        async with LoopStallMonitor(capture_slow_callbacks=True) as sleeping:
            await asyncio.sleep(0.01)
            time.sleep(0.05)  # what a blocking client call does to the loop
            await asyncio.sleep(0.01)
        # A sync kafka2pc call made on the loop is caught too (a broker round trip or more).
        with TransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:
            admin.describe_transaction("warm-up")  # connects
            async with LoopStallMonitor() as sync_call:
                await asyncio.sleep(0.01)
                start = time.monotonic()
                for _ in range(5):
                    admin.describe_transaction(f"k2pc-aio-absent-{uuid.uuid4().hex[:6]}")
                blocked = time.monotonic() - start
                await asyncio.sleep(0.01)
        return sleeping.report, sync_call.report, blocked

    sleeping, sync_call, blocked = run(main())
    print(f"\ntime.sleep(0.05): {sleeping.summary()}\nsync describe x5 ({blocked * 1e3:.1f} ms): {sync_call.summary()}")
    assert sleeping.max_stall_s >= 0.045
    assert any(secs >= 0.045 for secs, _ in sleeping.slow_callbacks), sleeping.slow_callbacks
    assert sync_call.max_stall_s >= blocked - 0.002
    assert sum(sync_call.lateness_s) >= 0.9 * blocked  # all of the blocking time shows up as stall


def test_the_harness_check_fails_on_a_blocking_call() -> None:
    """``assert_loop_not_blocked`` rejects a loop held by blocking sleeps, however busy the machine is:
    a sleeping thread is not waiting for a CPU, so none of the stall is put down to the scheduler.
    The loop that only awaits runs for 1 s, as the checked tests' windows do: in a 0.15 s window one
    hiccup of a shared machine (12 ms, none of it a wait for a CPU) is a third of the run."""

    async def main(blocking: bool) -> MeasuredLoop:
        async with MeasuredLoop() as loop_run:
            for _ in range(3 if blocking else 20):
                await asyncio.sleep(0.05)
                if blocking:
                    time.sleep(0.2)  # what a blocking client call does to the loop
        return loop_run

    assert_loop_not_blocked(run(main(False)), "asyncio.sleep only", stalled_fraction=STALLED_FRACTION_BOUND)
    with pytest.raises(AssertionError, match="ms"):
        assert_loop_not_blocked(run(main(True)), "time.sleep(0.2) x3 on the loop", stalled_fraction=STALLED_FRACTION_BOUND)


def test_no_call_blocks_the_loop_with_the_broker_healthy(
    kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory(partitions=3)
    producers, txns, records = 4, 25, 10

    async def transactions(n: int) -> None:
        tid = f"k2pc-aio-stall-{n}-{uuid.uuid4().hex[:6]}"
        async with AsyncTwoPhaseCommitProducer({"bootstrap.servers": kafka_bootstrap, "transactional.id": tid}) as p:
            await p.init_transactions(30)
            for t in range(txns):
                await p.begin_transaction()
                for i in range(records):
                    await p.produce(topic, value=f"{n}-{t}-{i}".encode())
                state = await p.prepare_transaction(30)
                if t % 5 == 4:
                    await p.abort_transaction(30)
                else:
                    await p.complete_transaction(state, 30)

    async def operator(stop: asyncio.Event) -> int:
        calls = 0
        async with AsyncTransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:
            while not stop.is_set():
                await admin.list_transactions(min_open_s=0)
                calls += 1
        return calls

    async def main() -> tuple[MeasuredLoop, int]:
        stop = asyncio.Event()
        async with MeasuredLoop() as monitor:
            admin_task = asyncio.ensure_future(operator(stop))
            await asyncio.gather(*(transactions(n) for n in range(producers)))
            stop.set()
            admin_calls = await admin_task
        return monitor, admin_calls

    loop_run, admin_calls = run(main())
    assert admin_calls > 0
    assert_loop_not_blocked(
        loop_run, f"broker healthy, {producers} producers x {txns} txns + {admin_calls} admin listings"
    )
    assert len(drain(kafka_bootstrap, topic)) == producers * txns * records * 4 // 5


@pytest.fixture
def private_kafka() -> Iterator[LocalKafka]:
    """A broker of this test's own (stopped and wiped afterwards), in this checkout's port block."""
    with private_broker("aio/test_loop_stall") as kafka:
        yield kafka


def test_no_call_blocks_the_loop_with_the_broker_stopped(private_kafka: LocalKafka) -> None:
    bootstrap = private_kafka.bootstrap_servers
    topic = create_topic(bootstrap)
    outcomes: dict[str, str] = {}

    async def timed(name: str, call: asyncio.Future[object] | asyncio.Task[object] | object, bound: float) -> None:
        start = time.monotonic()
        try:
            await asyncio.wait_for(call, bound)  # type: ignore[arg-type]
            outcome = "returned"
        except asyncio.TimeoutError:
            outcome = "still waiting"  # the loop stopped waiting; the call goes on in its thread
        except Kafka2pcError as exc:
            outcome = type(exc).__name__
        outcomes[name] = f"{outcome} after {time.monotonic() - start:.1f}s"

    def config(name: str) -> dict[str, object]:
        return {"bootstrap.servers": bootstrap, "transactional.id": f"k2pc-aio-down-{name}-{uuid.uuid4().hex[:6]}"}

    async def before() -> tuple[AsyncTwoPhaseCommitProducer, AsyncTwoPhaseCommitProducer, AsyncTransactionAdmin]:
        a, b = AsyncTwoPhaseCommitProducer(config("a")), AsyncTwoPhaseCommitProducer(config("b"))
        await asyncio.gather(a.init_transactions(30), b.init_transactions(30))
        await a.begin_transaction()
        await b.begin_transaction()
        await b.produce(topic, value=b"b")
        await b.prepare_transaction(30)
        admin = AsyncTransactionAdmin({"bootstrap.servers": bootstrap}, request_timeout_s=2)
        await admin.describe_transaction(a.transactional_id)
        return a, b, admin

    loop = asyncio.new_event_loop()
    try:
        a, b, admin = loop.run_until_complete(before())
        private_kafka.stop()

        c = AsyncTwoPhaseCommitProducer(config("c"))

        async def down() -> tuple[MeasuredLoop, float]:
            start = time.monotonic()
            async with MeasuredLoop() as monitor:
                delivery = await a.produce(topic, value=b"a")
                await asyncio.gather(
                    timed("a.prepare_transaction(3)", a.prepare_transaction(3), 20),
                    timed("b.commit_transaction(3)", b.commit_transaction(3), 20),
                    timed("admin.describe_transaction", admin.describe_transaction(a.transactional_id), 8),
                    timed("admin.list_transactions", admin.list_transactions(), 8),
                    timed("c.init_transactions(3)", c.init_transactions(3), 8),
                )
                assert not delivery.done()
            return monitor, time.monotonic() - start

        loop_run, elapsed = loop.run_until_complete(down())
        print(f"\nbroker stopped, outcomes: {outcomes}")
        # The loop kept ticking whenever its thread could run, and was not held (net of its wait for a CPU).
        assert_loop_not_blocked(loop_run, f"broker stopped ({elapsed:.1f}s)", stalled_fraction=STALLED_FRACTION_BOUND)
        assert elapsed >= 3  # the calls really waited on the dead broker
        assert outcomes["a.prepare_transaction(3)"].startswith(RetriableError.__name__)
        assert outcomes["b.commit_transaction(3)"].startswith(IndefiniteOutcomeError.__name__)
        assert b.state is TxnState.IN_DOUBT
        # init_transactions(timeout) ends within timeout + TIMEOUT_SLACK_S (1 s); 2 s more for a loaded machine.
        init_outcome = outcomes["c.init_transactions(3)"]
        assert init_outcome.startswith(BrokerUnavailableError.__name__), init_outcome
        assert float(init_outcome.rsplit(" ", 1)[1].rstrip("s")) <= 3 + 1 + 2, init_outcome

        # The broker comes back: the in-doubt commit is retried and succeeds; nothing was lost.
        private_kafka.start()

        async def after() -> None:
            await b.commit_transaction(60)
            assert b.state is TxnState.READY
            await a.abort_transaction(60)
            # The calls the test stopped waiting for end now (the broker is back); closing queues behind them.
            await asyncio.gather(a.close(), b.close(), c.close(), admin.close())

        loop.run_until_complete(asyncio.wait_for(after(), 120))
    finally:
        loop.close()
    assert [r.value for r in drain(bootstrap, topic)] == [b"b"]


def test_calls_stuck_on_a_dead_cluster_do_not_delay_a_healthy_producer(
    kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    """One thread per producer: eight producers waiting on an unreachable cluster hold eight threads, not the loop
    and not a shared pool, so a producer on a live cluster goes on at its usual pace."""
    topic = topic_factory()
    dead = f"127.0.0.1:{closed_port()}"  # nothing listens there

    async def main() -> tuple[float, MeasuredLoop, int]:
        stuck = [
            AsyncTwoPhaseCommitProducer({"bootstrap.servers": dead, "transactional.id": f"k2pc-aio-dead-{n}"})
            for n in range(8)
        ]
        pending = [asyncio.ensure_future(p.init_transactions(5)) for p in stuck]
        tid = f"k2pc-aio-alive-{uuid.uuid4().hex[:6]}"
        async with AsyncTwoPhaseCommitProducer({"bootstrap.servers": kafka_bootstrap, "transactional.id": tid}) as p:
            async with MeasuredLoop() as monitor:
                start = time.monotonic()
                await p.init_transactions(30)
                for t in range(5):
                    await p.begin_transaction()
                    await p.produce(topic, value=b"%d" % t)
                    await p.prepare_transaction(30)
                    await p.commit_transaction(30)
                healthy = time.monotonic() - start
        still_stuck = sum(1 for f in pending if not f.done())
        for f in pending:
            f.cancel()
        return healthy, monitor, still_stuck

    healthy, loop_run, still_stuck = run(main())
    print(f"\n5 transactions on a live cluster in {healthy:.2f}s while {still_stuck} of 8 producers wait on a dead one")
    assert still_stuck == 8  # the dead cluster's calls were still waiting (30 s bootstrap) ...
    assert healthy < 10  # ... and did not hold up the live producer
    # No tick over the bound but those the loop thread's wait for a CPU explains, no slow callback.
    assert_loop_not_blocked(loop_run, "a live producer next to 8 stuck ones", late_ticks=0)
    assert sorted(r.value or b"" for r in drain(kafka_bootstrap, topic)) == [b"%d" % t for t in range(5)]
