"""A cancelled ``adual_write()`` (Django cancels an async view whose client went away) leaves nothing open.

One test per database (SQLite, PostgreSQL, MariaDB) cancels the task at each of its await points in turn:
while it waits for a free transactional id (the pool's only slot is held by another thread), while its
entry runs (lease, Kafka begin, state-row lock), at an ``await tx.produce()``, at an ``await`` of the
application's in the block, and while its end runs (prepare, COMMIT, Kafka commit).  After each, the next
block runs at once on the same slot (the slot, its state-row lock and its producer are free); at the end,
rows = ``read_committed`` records, no lease is held once the pool is closed, and Kafka's own
``TransactionsCommand`` finds no hanging transaction on the topic.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from djtest.models import Item
from kafka2pc.recipes.django import adual_write, dual_write
from kafka2pc.recipes.django._runtime import close_all
from kafka2pc.recipes.django.models import WriterLease
from kafka2pc.recipes.dual_write import Step

from kafka2pc.testing import drain, end_offsets, settled_end_offsets
from kafka2pc.testing.kafka_tools import transactions_command

POINTS = ("waiting for an id", "entry", "produce", "in the block", "end")
HOLD_S = 0.6
"""How long a step hook holds the block's thread at its point, while the task is cancelled."""


def _records(bootstrap: str, topic: str) -> list[str]:
    return sorted(r.value.decode() for r in drain(bootstrap, topic, "read_committed") if r.value)


def test_a_cancellation_at_each_await_point_leaves_nothing_open(alias: str, k2pc_settings: dict[str, Any],
                                                                kafka_bootstrap: str, topic_factory: Any) -> None:
    topic = topic_factory()
    hold: dict[str, Step | None] = {"step": None}
    reached = threading.Event()

    def hook(step: Step) -> None:
        if step is hold["step"]:
            hold["step"] = None
            reached.set()
            time.sleep(HOLD_S)

    close_all()
    k2pc_settings["POOL_OPTIONS"] = {**k2pc_settings["POOL_OPTIONS"], "max_slots": 1, "on_step": hook}

    async def block(rid: str, in_block: Callable[[], Any] | None = None) -> None:
        async with adual_write(using=alias) as tx:
            await Item.objects.using(alias).acreate(id=rid, series="s")
            await tx.produce(topic, value=rid.encode(), key=rid.encode())
            if in_block is not None:
                await in_block()

    async def cancel_at(point: str) -> float:
        rid = f"cancelled-{POINTS.index(point)}"
        holder: threading.Thread | None = None
        release = threading.Event()
        in_block = None
        if point == "waiting for an id":
            def hold_the_slot() -> None:
                try:
                    with dual_write(using=alias) as tx:
                        tx.produce(topic, value=b"holder", key=b"holder")
                        Item.objects.using(alias).create(id="holder", series="s")
                        reached.set()
                        release.wait(30)
                finally:
                    connections[alias].close()

            holder = threading.Thread(target=hold_the_slot)
            holder.start()
            while not reached.is_set():  # the holder has the only slot before the task asks for one
                await asyncio.sleep(0.005)
        elif point == "in the block":
            async def in_block() -> None:
                reached.set()
                await asyncio.sleep(30)
        else:
            hold["step"] = {"entry": Step.DB_BEGUN, "produce": Step.PRODUCED, "end": Step.PREPARED}[point]
        if point == "waiting for an id":
            reached.clear()
        task = asyncio.ensure_future(block(rid, in_block))
        if point == "waiting for an id":
            await asyncio.sleep(0.3)  # the task is now waiting for the slot
            reached.set()
        while not reached.is_set():
            await asyncio.sleep(0.005)
        reached.clear()
        started = time.monotonic()
        was_done = task.done()
        task.cancel()
        if holder is not None:
            release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
            pytest.fail(f"{point}: the block ended before its cancellation ({was_done=})")
        released_after = time.monotonic() - started
        if holder is not None:
            await asyncio.to_thread(holder.join, 30)
        # The only slot is free again, and so are its state-row lock and its producer: the next block runs at once.
        started = time.monotonic()
        await block(f"after-{POINTS.index(point)}")
        assert time.monotonic() - started < 10, point
        return released_after

    async def main() -> dict[str, float]:
        try:
            return {point: await cancel_at(point) for point in POINTS}
        finally:
            await sync_to_async(connections.close_all)()

    took = asyncio.run(main())
    print(f"\n{alias}: cancellation returned after " + ", ".join(f"{p}: {s:.2f} s" for p, s in took.items()))
    close_all()
    rows = sorted(Item.objects.using(alias).values_list("id", flat=True))
    assert rows == _records(kafka_bootstrap, topic)
    assert {f"after-{i}" for i in range(len(POINTS))} | {"holder"} <= set(rows)
    assert not {f"cancelled-{i}" for i in range(len(POINTS) - 1)} & set(rows)  # cancelled before the end
    assert settled_end_offsets(kafka_bootstrap, topic) == end_offsets(kafka_bootstrap, topic, "read_uncommitted")
    assert not WriterLease.objects.using(alias).exclude(owner=None).exists()  # every lease given back
    assert transactions_command(kafka_bootstrap, "find-hanging", "--topic", topic,
                                "--max-transaction-timeout", "0") == []
