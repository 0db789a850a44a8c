"""The async handle over a sync :class:`DualWriteTransaction`, shared by the asyncio writers and Django's
``adual_write()``; it imports nothing of asyncio's drivers, so the Django app needs no asyncio extra."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kafka2pc import PreparedTxnState

from ._handle import DualWriteTransaction

__all__ = ["AsyncTransactionHandle"]


class AsyncTransactionHandle:
    """:class:`DualWriteTransaction`'s methods as coroutines, over a sync handle; a subclass says where its
    calls run (:meth:`_call`): the event loop's greenlet bridge here, Django's block thread in the Django app."""

    def __init__(self, handle: DualWriteTransaction) -> None:
        self._handle = handle

    async def _call(self, call: Callable[[], None]) -> None:
        raise NotImplementedError

    @property
    def transactional_id(self) -> str:
        """The Kafka transactional id this transaction runs under."""
        return self._handle.transactional_id

    @property
    def prepared_state(self) -> PreparedTxnState | None:
        """The state stored in the database once the transaction is prepared."""
        return self._handle.prepared_state

    @property
    def records_produced(self) -> int:
        """How many records this transaction produced so far."""
        return self._handle.records_produced

    async def produce(
        self,
        topic: str,
        value: str | bytes | None = None,
        key: str | bytes | None = None,
        partition: int | None = None,
        on_delivery: Callable[[Any, Any], None] | None = None,
        timestamp: int | None = None,
        headers: Mapping[str, str | bytes | None] | Sequence[tuple[str, str | bytes | None]] | None = None,
    ) -> None:
        """Produce one record in the transaction (arguments as :meth:`DualWriteTransaction.produce`).

        Returns once librdkafka has the record (an enqueue; the prepare
        waits for its delivery).  ``error`` in ``on_delivery(error, message)``
        is the kafka2pc error of a failed delivery.  A full local queue is
        waited out for up to the writer's ``queue_full_timeout_s``; the first
        record of a topic the writer has not seen yet waits for one metadata
        request.  With :class:`AsyncDualWriter` these waits do not block the
        loop and ``on_delivery`` runs on the loop.
        """
        await self._call(lambda: self._handle.produce(topic, value, key, partition=partition, headers=headers,
                                                      timestamp=timestamp, on_delivery=on_delivery))

    async def send_offsets_to_transaction(self, offsets: list[Any], group_metadata: Any) -> None:
        """Commit consumer offsets with this transaction (exactly-once consume-transform-produce)."""
        await self._call(lambda: self._handle.send_offsets_to_transaction(offsets, group_metadata))

    async def send_consumer_offsets(self, consumer: Any) -> None:
        """Commit the current positions of ``consumer``'s assignment (a ``confluent_kafka.Consumer``)."""
        await self._call(lambda: self._handle.send_consumer_offsets(consumer))
