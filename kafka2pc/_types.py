"""Small immutable value types shared by the kafka2pc layers.

They are plain frozen dataclasses, independent of both client libraries
underneath (confluent-kafka and kafka-python), so that the core and the
recipes never have to import either library's structs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kafka2pc._deprecation import deprecated_property

__all__ = [
    "OPEN_STATES",
    "InitProducerIdResult",
    "OnHeuristic",
    "PartitionLag",
    "ProducerState",
    "TopicAndPartition",
    "TransactionDescription",
    "TransactionInfo",
    "TransactionListing",
]


@dataclass(frozen=True, order=True)
class TopicAndPartition:
    """One partition of one topic, as kafka2pc's admin calls take and return it.

    A plain value (hashable, ordered), independent of confluent-kafka's
    mutable ``confluent_kafka.TopicPartition``, which
    :meth:`~kafka2pc.TwoPhaseCommitProducer.send_offsets_to_transaction` takes
    (with the offsets to commit).
    """

    topic: str
    partition: int


TopicPartition = TopicAndPartition
"""The spelling the private modules use (the public name is :class:`TopicAndPartition`)."""


@dataclass(frozen=True)
class TransactionDescription:
    """What the transaction coordinator knows about one transactional id.

    ``state`` is the coordinator's wire state: ``Empty``, ``Ongoing``,
    ``PrepareCommit``, ``PrepareAbort``, ``CompleteCommit``, ``CompleteAbort``,
    ``Dead`` or ``PrepareEpochFence``.  ``start_time_ms`` is ``-1`` when no
    transaction has started.  ``partitions`` are the partitions the *current*
    transaction has added (empty once it completed).  ``timeout_ms`` is the
    coordinator's value in its unit; :attr:`timeout_s` is the same in seconds.
    """

    transactional_id: str
    state: str
    producer_id: int
    producer_epoch: int
    timeout_ms: int
    start_time_ms: int
    partitions: tuple[TopicAndPartition, ...]
    coordinator_id: int

    @property
    def timeout_s(self) -> float:
        """The transaction timeout in seconds (``timeout_ms``, the coordinator's wire value, divided by 1000)."""
        return self.timeout_ms / 1000


@dataclass(frozen=True)
class ProducerState:
    """One active producer on a partition, as reported by DescribeProducers.

    ``current_txn_start_offset`` is the offset of the first record of the
    producer's open transaction on that partition, ``-1`` when none is open.
    Together with the producer id it names exactly one transaction even when
    the producer id and epoch are reused by consecutive transactions (TV1).
    """

    producer_id: int
    producer_epoch: int
    last_sequence: int
    last_timestamp_ms: int
    coordinator_epoch: int
    current_txn_start_offset: int


@dataclass(frozen=True)
class TransactionListing:
    """One row of ListTransactions."""

    transactional_id: str
    producer_id: int
    state: str


@dataclass(frozen=True)
class InitProducerIdResult:
    """The answer to InitProducerId.

    ``ongoing_txn_producer_id``/``ongoing_txn_epoch`` are the KIP-939 fields
    naming a prepared transaction that was *kept* (``keepPreparedTxn=true``);
    ``-1`` when none was kept or the request version has no such fields.
    """

    producer_id: int
    producer_epoch: int
    ongoing_txn_producer_id: int = -1
    ongoing_txn_epoch: int = -1


OPEN_STATES = frozenset({"Ongoing", "PrepareCommit", "PrepareAbort", "PrepareEpochFence"})
"""The coordinator states of a transaction that is neither committed nor aborted."""

OnHeuristic = Literal["raise", "report", "acknowledge"]
OnHeuristic.__doc__ = """What a settlement does when Kafka aborted the transaction a prepared state names.

That is a heuristic outcome.  The one policy of every settling call (:meth:`TransactionAdmin.complete_transaction`,
:meth:`TransactionAdmin.settle_many`, their asyncio twins, and the dual-write
recipe's ``recover``).  ``"raise"`` (the default everywhere): raise
:class:`HeuristicOutcomeError`.  ``"report"``: return it (in the
:class:`Settlement`, or the recipe's ``RecoveryResult``) and raise nothing.
``"acknowledge"``: report it, and let the owner of the stored prepared state
clear it (the dual-write recipe clears its state row); an admin, which stores
no state, reports it as ``"report"`` does.
"""


@dataclass(frozen=True)
class PartitionLag:
    """What an open transaction costs ``read_committed`` consumers on one partition.

    ``held_back = high_watermark - last_stable_offset``: records (of any
    producer) that ``read_committed`` consumers cannot read yet.
    """

    topic: str
    partition: int
    last_stable_offset: int
    high_watermark: int

    @property
    def held_back(self) -> int:
        """Records hidden from ``read_committed`` consumers behind the last stable offset."""
        return max(0, self.high_watermark - self.last_stable_offset)


@dataclass(frozen=True)
class TransactionInfo:
    """One transaction as the coordinator sees it, with its age and its cost to consumers."""

    description: TransactionDescription
    open_for_s: float | None
    """Seconds since the transaction started (``None`` when none is open)."""
    partitions: tuple[PartitionLag, ...]

    open_for_ms = deprecated_property(
        "open_for_ms", "open_for_s", lambda self: -1 if self.open_for_s is None else round(self.open_for_s * 1000)
    )

    @property
    def transactional_id(self) -> str:
        """The transactional id."""
        return self.description.transactional_id

    @property
    def state(self) -> str:
        """The coordinator's state (``Ongoing``, ``CompleteCommit``, ...)."""
        return self.description.state

    @property
    def is_open(self) -> bool:
        """True while the transaction is neither committed nor aborted."""
        return self.description.state in OPEN_STATES
