"""What :mod:`kafka2pc.otel` keeps of each instrumented object (it uses only their public API)."""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kafka2pc import TxnState

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from kafka2pc import TwoPhaseCommitProducer


_W = TypeVar("_W")
"""``DualWriter``, ``WriterPool``, ``AsyncDualWriter`` or ``AsyncWriterPool``."""


_S = TypeVar("_S")
"""``kafka2pc.recipes.spark_sink.KafkaTwoPhaseSink`` or what ``kafka2pc.recipes.spark.register_data_source``
returns (a monitor whose ``add_batch_listener`` reports each batch)."""

COMPONENT = "kafka2pc.component"
"""The attribute naming what a point or span is about: ``producer``, ``dual_write`` or ``spark_sink``."""
TRANSACTIONAL_ID = "kafka2pc.transactional_id"
POOL = "kafka2pc.pool"
SINK_ID = "kafka2pc.sink_id"

_OPEN_STATES = frozenset(
    {TxnState.IN_TRANSACTION, TxnState.PREPARED, TxnState.IN_DOUBT, TxnState.ABORTABLE_ERROR}
)
_PREPARED_STATES = frozenset({TxnState.PREPARED, TxnState.IN_DOUBT})


@dataclass
class _ProducerTrack:
    producer: weakref.ref[TwoPhaseCommitProducer]
    attributes: dict[str, str]
    open_since: float | None = None
    prepared_since: float | None = None


@dataclass
class _SlotTrack:
    """One writer's transaction in progress (a pool has one per slot): its phase spans and its prepare."""

    attributes: dict[str, str]
    prepared_since: float | None = None
    spans: dict[str, tuple[Span, float]] = field(default_factory=dict)
    rolled_back_at_begin: int = 0


@dataclass
class _WriterTrack:
    """A writer or a pool: its counters' last values, and a :class:`_SlotTrack` per writer that ran."""

    writer: weakref.ref[Any]
    """The writer or pool instrumented (sync or asyncio)."""
    attributes: dict[str, str]
    snapshot: Callable[[Any], Any]
    """The writer's (or the pool's summed) ``DualWriteMetrics`` snapshot."""
    seen: dict[str, int] = field(default_factory=dict)
    slots: weakref.WeakKeyDictionary[Any, _SlotTrack] = field(default_factory=weakref.WeakKeyDictionary)
    """Per writer (a pool's retired slots drop out with their writers)."""

    def metrics(self) -> Any:
        target = self.writer()
        return None if target is None else self.snapshot(target)

    def slot(self, writer: Any) -> _SlotTrack:
        track = self.slots.get(writer)
        if track is None:
            track = self.slots[writer] = _SlotTrack({**self.attributes, TRANSACTIONAL_ID: writer.transactional_id})
        return track

    @property
    def prepared_since(self) -> float | None:
        """When the oldest transaction still prepared was prepared (``None``: none is)."""
        times = [s.prepared_since for s in list(self.slots.values()) if s.prepared_since is not None]
        return min(times) if times else None


@dataclass
class _SinkTrack:
    sink: Any
    open_since: float | None = None
    counted: deque[int] = field(default_factory=lambda: deque(maxlen=1000))
    """Batch ids whose commits were counted: a replay in the same process does not count them again."""

    @property
    def attributes(self) -> dict[str, str]:
        return {COMPONENT: "spark_sink", SINK_ID: self.sink.sink_id or ""}
