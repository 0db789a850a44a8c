"""The asyncio transaction scope's task (``ScopeRun``): what a cancellation or an error of the caller does.

A sync context manager stands in for the writer's scope (no database, no broker): it records what
it was told, and waits on the loop (through the greenlet bridge) where the real one waits on the
pool's slot, the database or the producer's thread.  The real scopes run under these rules in the
pool's and the writer's tests (cancelled while waiting for a slot, while committing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from kafka2pc.recipes.dual_write.aio._bridge import ScopeRun, current_scope, wait_for
from kafka2pc.recipes.dual_write.aio._runtime import EVENT_LOOP


class _Scope:
    """Records the scope's life; ``entering`` / ``leaving`` let the loop run while it enters / leaves."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.entering = asyncio.Event()
        self.entering.set()
        self.leaving = asyncio.Event()
        self.leaving.set()
        self.fail_entering: BaseException | None = None

    @contextmanager
    def scope(self) -> Iterator[str]:
        wait_for(self.entering.wait())
        if self.fail_entering is not None:
            self.events.append("failed to enter")
            raise self.fail_entering
        self.events.append("entered")
        try:
            yield "handle"
        except BaseException as exc:
            wait_for(self.leaving.wait())
            self.events.append(f"left with {type(exc).__name__}")
            if isinstance(exc, KeyError):
                return  # suppressed
            raise
        wait_for(self.leaving.wait())
        self.events.append("left")


def _run(scenario: Any) -> Any:
    return asyncio.run(scenario())


def test_a_block_that_ends_normally_leaves_the_scope_before_the_caller_goes_on() -> None:
    async def scenario() -> list[str]:
        s = _Scope()
        async with ScopeRun(s.scope()) as handle:
            assert handle == "handle"
            s.events.append("block")
        return s.events

    assert _run(scenario) == ["entered", "block", "left"]


def test_an_error_of_the_block_goes_to_the_scope_and_is_raised_unless_suppressed() -> None:
    async def scenario() -> list[str]:
        s = _Scope()
        with pytest.raises(ValueError, match="in the block"):
            async with ScopeRun(s.scope()):
                raise ValueError("in the block")
        async with ScopeRun(s.scope()):
            raise KeyError("suppressed by the scope")
        return s.events

    assert _run(scenario) == ["entered", "left with ValueError", "entered", "left with KeyError"]


def test_an_error_entering_is_raised_and_nothing_is_left() -> None:
    async def scenario() -> list[str]:
        s = _Scope()
        s.fail_entering = RuntimeError("no slot")
        with pytest.raises(RuntimeError, match="no slot"):
            async with ScopeRun(s.scope()):
                raise AssertionError("the block must not run")
        return s.events

    assert _run(scenario) == ["failed to enter"]


def test_a_caller_cancelled_while_entering_gets_cancelled_after_the_scope_was_left() -> None:
    async def scenario() -> list[str]:
        s = _Scope()
        s.entering.clear()

        async def caller() -> None:
            async with ScopeRun(s.scope()):
                raise AssertionError("the block must not run")

        task = asyncio.ensure_future(caller())
        await asyncio.sleep(0.01)  # the scope task waits to enter
        task.cancel()
        await asyncio.sleep(0.01)
        assert not task.done(), "the caller must wait until the entry ended and the scope was left"
        s.entering.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        return s.events

    assert _run(scenario) == ["entered", "left with CancelledError"]


def test_a_caller_cancelled_while_the_scope_is_left_gets_cancelled_once_it_was_left() -> None:
    async def scenario() -> list[str]:
        s = _Scope()
        s.leaving.clear()

        async def caller() -> None:
            async with ScopeRun(s.scope()):
                s.events.append("block")

        task = asyncio.ensure_future(caller())
        await asyncio.sleep(0.01)  # the scope task waits to leave
        task.cancel()
        await asyncio.sleep(0.01)
        assert not task.done(), "a cancellation must not interrupt leaving the scope"
        s.leaving.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        return s.events

    assert _run(scenario) == ["entered", "block", "left"]


def test_background_calls_of_the_scope_run_in_its_task_after_the_caller_was_answered() -> None:
    """The pipelined Kafka commit: deferred while leaving, run once the caller goes on (or at once if waited for)."""

    async def scenario() -> list[str]:
        events: list[str] = []
        workers = EVENT_LOOP.workers(1, "test")
        done = EVENT_LOOP.event()

        def commit() -> None:
            events.append(f"commit starts in the scope's task: {current_scope() is not None}")
            wait_for(asyncio.sleep(0.01))  # the Kafka commit waits for the producer's thread
            events.append("commit done")
            done.set()

        @contextmanager
        def scope(wait: bool) -> Iterator[None]:
            yield
            workers.spawn(commit)
            if wait:
                done.wait(5)  # as wait_visible=True: the deferred call must start now, in a task
                events.append("waited for the commit")
            events.append("left")

        async with ScopeRun(scope(wait=False)):
            pass
        events.append("caller answered")
        await asyncio.sleep(0.05)
        done = EVENT_LOOP.event()
        async with ScopeRun(scope(wait=True)):
            pass
        events.append("caller answered")
        return events

    assert _run(scenario) == [
        "left", "commit starts in the scope's task: True", "caller answered", "commit done",
        "commit starts in the scope's task: False", "commit done", "waited for the commit", "left",
        "caller answered",
    ]
