"""The per-client thread of kafka2pc.aio, without a broker: order, cancellation, errors, wake-ups, exports."""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import pytest
from harness.loop import run

import kafka2pc.aio
from kafka2pc import IllegalStateError
from kafka2pc.aio._worker import SerialWorker


def test_calls_run_in_order_on_the_worker_thread_never_on_the_loop() -> None:
    async def main() -> None:
        worker = SerialWorker("t-order")
        loop = asyncio.get_running_loop()
        seen: list[tuple[int, str]] = []

        def call(n: int) -> int:
            time.sleep(0.001 * (5 - n))  # earlier calls are slower: order must still hold
            seen.append((n, threading.current_thread().name))
            return n

        results = await asyncio.gather(*(worker.submit(loop, functools.partial(call, n), lambda: None) for n in range(5)))
        assert results == [0, 1, 2, 3, 4]
        assert seen == [(n, "t-order") for n in range(5)]
        worker.stop()

    run(main())


def test_a_cancelled_caller_does_not_stop_the_call_and_the_next_call_sees_it() -> None:
    async def main() -> None:
        worker = SerialWorker("t-cancel")
        loop = asyncio.get_running_loop()
        started, state, finished = threading.Event(), [], []

        def slow() -> str:
            started.set()
            time.sleep(0.05)
            state.append("done")
            return "ignored"

        waiting = asyncio.ensure_future(worker.submit(loop, slow, lambda: finished.append(True)))
        queued = asyncio.ensure_future(worker.submit(loop, lambda: state.append("queued"), lambda: None))
        await asyncio.to_thread(started.wait, 5)
        waiting.cancel()
        queued.cancel()  # not started yet: it still runs
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await worker.submit(loop, lambda: list(state), lambda: None) == ["done", "queued"]
        assert finished == [True]  # the bookkeeping callback ran although nobody waited
        worker.stop()

    run(main())


def test_errors_reach_the_awaiting_task_with_their_class() -> None:
    async def main() -> None:
        worker = SerialWorker("t-errors")
        loop = asyncio.get_running_loop()

        def fail() -> None:
            raise IllegalStateError("refused")

        with pytest.raises(IllegalStateError, match="refused"):
            await worker.submit(loop, fail, lambda: None)
        assert await worker.submit(loop, lambda: 42, lambda: None) == 42  # the thread survives
        worker.stop()
        with pytest.raises(RuntimeError, match="stopped"):
            worker.submit(loop, lambda: 1, lambda: None)

    run(main())


def test_wake_makes_a_sleeping_worker_serve_soon() -> None:
    pending = threading.Event()
    served = threading.Event()

    def serve() -> None:
        pending.clear()
        served.set()

    worker = SerialWorker("t-wake", idle=pending.is_set, serve=serve, idle_interval=0.001)
    time.sleep(0.05)  # asleep without a timeout: nothing pending
    assert not served.is_set()
    pending.set()
    worker.wake()
    assert served.wait(2), "the worker did not serve after wake()"
    worker.stop()
    worker.thread.join(2)
    assert not worker.thread.is_alive()


def test_a_result_for_a_closed_loop_does_not_kill_the_thread() -> None:
    worker = SerialWorker("t-closed")
    gate = threading.Event()

    async def first() -> None:
        asyncio.ensure_future(worker.submit(asyncio.get_running_loop(), lambda: gate.wait(5), lambda: None))
        await asyncio.sleep(0)

    asyncio.run(first())  # the loop closes while the call is still running
    gate.set()

    async def second() -> int:
        return await worker.submit(asyncio.get_running_loop(), lambda: 7, lambda: None)

    assert run(second()) == 7
    worker.stop()


def test_the_public_names_of_kafka2pc_aio() -> None:
    assert kafka2pc.aio.__all__ == sorted(kafka2pc.aio.__all__)
    assert kafka2pc.aio.__all__ == [
        "AsyncTransactionAdmin", "AsyncTwoPhaseCommitProducer", "LoopStallMonitor", "StallReport", "UNPAIRED",
    ]
    assert isinstance(kafka2pc.aio.UNPAIRED, dict) and kafka2pc.aio.UNPAIRED  # the list of what has no twin
    for name in kafka2pc.aio.__all__:
        if name.isupper():
            continue
        obj = getattr(kafka2pc.aio, name)
        assert obj.__module__ == "kafka2pc.aio"
        assert obj.__doc__ and "Example" in obj.__doc__, name
