"""The handle :meth:`DualWriter.transaction` yields."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kafka2pc import PreparedTxnState

from ._values import Step, _as_bytes, _normalize_headers, _Record

if TYPE_CHECKING:
    from kafka2pc import TwoPhaseCommitProducer

    from ._core import WriterCore

__all__ = ["DualWriteTransaction", "TransactionContents", "open_handle"]


@dataclass(eq=False)
class TransactionContents:
    """What a handle and the writer's runner share about one transaction: the records the handle produced
    (copied to the outbox table after the prepare) and the prepared state the runner stored."""

    records: list[_Record] = field(default_factory=list)
    prepared: PreparedTxnState | None = None


class DualWriteTransaction:
    """The handle :meth:`DualWriter.transaction` yields: produce records, add consumer offsets.

    Rows are written with the Session or Connection the transaction was
    opened on (also available as :attr:`connection`); they commit together
    with the records produced here.
    """

    def __init__(self, writer: WriterCore, producer: TwoPhaseCommitProducer, connection: sa.Connection) -> None:
        self._writer = writer
        self._producer = producer
        self._connection = connection
        self._contents = TransactionContents()
        self._produced = 0

    @property
    def connection(self) -> sa.Connection:
        """The database connection of this transaction."""
        return self._connection

    @property
    def transactional_id(self) -> str:
        """The Kafka transactional id this transaction runs under."""
        return self._producer.transactional_id

    @property
    def prepared_state(self) -> PreparedTxnState | None:
        """The state stored in the database once the transaction is prepared."""
        return self._contents.prepared

    @property
    def records_produced(self) -> int:
        """How many records this transaction produced so far."""
        return self._produced

    def produce(
        self,
        topic: str,
        value: str | bytes | None = None,
        key: str | bytes | None = None,
        partition: int | None = None,
        on_delivery: Callable[[Any, Any], None] | None = None,
        timestamp: int | None = None,
        headers: Mapping[str, str | bytes | None] | Sequence[tuple[str, str | bytes | None]] | None = None,
    ) -> None:
        """Produce one record in the transaction: the parameters of :meth:`kafka2pc.TwoPhaseCommitProducer.produce`.

        A full local queue is waited out (serving delivery reports) for up to
        the writer's ``queue_full_timeout_s``.
        """
        key_b = key if key is None or key.__class__ is bytes else _as_bytes(key)
        value_b = value if value is None or value.__class__ is bytes else _as_bytes(value)
        header_list = None if headers is None else _normalize_headers(headers)
        self._produced += 1
        kwargs: dict[str, Any] = {"value": value_b, "key": key_b}
        writer = self._writer
        if writer.retain:
            record = _Record(topic, key_b, value_b, partition, header_list)
            self._contents.records.append(record)  # copied to the outbox table after the prepare

            def delivered(err: Any, msg: Any) -> None:
                if err is None:
                    record.partition = msg.partition()  # re-published to the same partition
                if on_delivery is not None:
                    on_delivery(err, msg)

            kwargs["on_delivery"] = delivered
        elif on_delivery is not None:
            kwargs["on_delivery"] = on_delivery
        if partition is not None:
            kwargs["partition"] = partition
        if header_list is not None:
            kwargs["headers"] = header_list
        if timestamp is not None:
            kwargs["timestamp"] = timestamp
        writer.produce(self._producer, topic, kwargs)
        if writer.listeners.active:
            writer.step(Step.PRODUCED)

    def send_offsets_to_transaction(self, offsets: list[Any], group_metadata: Any) -> None:
        """Commit consumer offsets with this transaction (exactly-once consume-transform-produce).

        ``offsets`` are ``confluent_kafka.TopicPartition`` positions (the next
        offset to read), ``group_metadata`` is ``consumer.consumer_group_metadata()``.
        """
        self._producer.send_offsets_to_transaction(offsets, group_metadata)

    def send_consumer_offsets(self, consumer: Any) -> None:
        """Commit the current positions of ``consumer``'s assignment with this transaction."""
        positions = [tp for tp in consumer.position(consumer.assignment()) if tp.offset >= 0]
        if positions:
            self.send_offsets_to_transaction(positions, consumer.consumer_group_metadata())


def open_handle(
    core: WriterCore, producer: TwoPhaseCommitProducer, connection: sa.Connection
) -> tuple[DualWriteTransaction, TransactionContents]:
    """A new handle, and the contents the runner fills in (the prepared state) and reads (the records)."""
    tx = DualWriteTransaction(core, producer, connection)
    return tx, tx._contents
