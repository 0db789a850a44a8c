"""The calls of a sync :class:`DualWriteTransaction` as coroutines, shared by the asyncio writers' handle and
Django's ``adual_write()`` handle; it imports nothing of asyncio's drivers, so the Django app needs no asyncio
extra.

Each public async handle holds an :class:`AsyncHandleCalls`, given the place its calls run (the event loop's
greenlet bridge, or Django's block thread), and forwards to it: the handles share this object, not a base class.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ._handle import DualWriteTransaction

__all__ = ["AsyncHandleCalls", "Headers"]

Headers = Mapping[str, str | bytes | None] | Sequence[tuple[str, str | bytes | None]]
"""What :meth:`DualWriteTransaction.produce` takes as ``headers``."""


class AsyncHandleCalls:
    """``handle``'s calls, each run by ``run`` (a coroutine function that runs one sync call where it belongs)."""

    def __init__(self, handle: DualWriteTransaction, run: Callable[[Callable[[], None]], Awaitable[None]]) -> None:
        self.handle = handle
        self._run = run

    async def produce(
        self,
        topic: str,
        value: str | bytes | None,
        key: str | bytes | None,
        partition: int | None,
        on_delivery: Callable[[Any, Any], None] | None,
        timestamp: int | None,
        headers: Headers | None,
    ) -> None:
        await self._run(lambda: self.handle.produce(topic, value, key, partition=partition, headers=headers,
                                                    timestamp=timestamp, on_delivery=on_delivery))

    async def send_offsets_to_transaction(self, offsets: list[Any], group_metadata: Any) -> None:
        await self._run(lambda: self.handle.send_offsets_to_transaction(offsets, group_metadata))

    async def send_consumer_offsets(self, consumer: Any) -> None:
        await self._run(lambda: self.handle.send_consumer_offsets(consumer))
