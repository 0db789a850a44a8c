"""Fork detection of the asyncio twins: inherited through fork(), they fail at once in the child.

The producer's and the admin's own threads live only in the parent, so a call
queued for them in a child would never return: each coroutine raises
:class:`kafka2pc.ForkedProcessError` before queueing anything, and ``close()``
returns at once.  The parent keeps using the same objects afterwards.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from harness.forks import FORK_KINDS, in_forked_child

from kafka2pc import ForkedProcessError, TxnState
from kafka2pc.aio import AsyncTransactionAdmin, AsyncTwoPhaseCommitProducer
from kafka2pc.testing import create_topic, drain


def attempts(calls: dict[str, Callable[[], Awaitable[Any]]], close: Callable[[], Awaitable[None]]) -> Any:
    """In the child, on a new event loop: each call's error and duration, then close()'s duration."""

    async def main() -> dict[str, Any]:
        seen: dict[str, Any] = {"pid": os.getpid()}
        for name, call in calls.items():
            started = time.monotonic()
            try:
                await asyncio.wait_for(call(), 10)
                seen[name] = {"error": None}
            except ForkedProcessError as exc:
                seen[name] = {"error": "ForkedProcessError", "pid": exc.pid, "message": str(exc)}
            except Exception as exc:  # noqa: BLE001 - reported, and the test fails on it
                seen[name] = {"error": f"{type(exc).__name__}: {exc}"}
            seen[name]["seconds"] = time.monotonic() - started
        started = time.monotonic()
        await asyncio.wait_for(close(), 10)
        seen["close_seconds"] = time.monotonic() - started
        return seen

    return lambda: asyncio.run(main())


def assert_refused_at_once(seen: dict[str, Any], calls: list[str]) -> None:
    assert seen["pid"] != os.getpid()
    for name in calls:
        assert seen[name]["error"] == "ForkedProcessError", (name, seen[name])
        assert seen[name]["pid"] == os.getpid(), (name, seen[name])
        assert f"made in process {os.getpid()}" in seen[name]["message"], seen[name]
        assert seen[name]["seconds"] < 1.0, (name, seen[name])
    assert seen["close_seconds"] < 1.0, seen


@pytest.mark.parametrize("kind", FORK_KINDS)
def test_async_producer_and_admin_in_a_forked_child_raise_at_once_and_the_parent_goes_on(
    kafka_bootstrap: str, tid: str, kind: str
) -> None:
    topic = create_topic(kafka_bootstrap)
    producer = AsyncTwoPhaseCommitProducer({"bootstrap.servers": kafka_bootstrap, "transactional.id": tid})
    admin = AsyncTransactionAdmin({"bootstrap.servers": kafka_bootstrap})

    async def warm_up() -> None:
        await producer.init_transactions(30)
        await producer.begin_transaction()
        await producer.produce(topic, value=b"before the fork")
        await producer.commit_transaction(30)
        assert await admin.describe_transaction(tid) is not None

    loop = asyncio.new_event_loop()  # the parent's one loop (the producer is bound to it); not running at the fork
    loop.run_until_complete(warm_up())

    async def close_both() -> None:
        await producer.close(5)
        await admin.close(5)

    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "begin_transaction": producer.begin_transaction,
        "produce": lambda: producer.produce(topic, value=b"from the child"),
        "flush": lambda: producer.flush(5),
        "wait_idle": producer.wait_idle,
        "describe_transaction": lambda: admin.describe_transaction(tid),
        "list_transactions": admin.list_transactions,
    }
    seen = in_forked_child(kind, attempts(calls, close_both))
    assert_refused_at_once(seen, list(calls))

    async def after() -> None:
        assert producer.state is TxnState.READY
        await producer.begin_transaction()
        await producer.produce(topic, value=b"after the fork")
        state = await producer.prepare_transaction(30)
        await producer.complete_transaction(state, 30)
        info = await admin.describe_transaction(tid)
        assert info is not None
        await producer.close()
        await admin.close()

    try:
        loop.run_until_complete(after())
    finally:
        loop.close()
    assert sorted(r.value for r in drain(kafka_bootstrap, topic)) == [b"after the fork", b"before the fork"]
