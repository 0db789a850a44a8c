"""What :mod:`kafka2pc.otel` keeps of each instrumented object, and the shapes of the objects it accepts."""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from kafka2pc import TxnState

if TYPE_CHECKING:
    from opentelemetry.trace import Span
    from pyspark.sql import DataFrame

    from kafka2pc import TwoPhaseCommitProducer


class _StepLike(Protocol):
    @property
    def value(self) -> str: ...


class _DualWriteMetricsLike(Protocol):
    @property
    def oldest_open_transaction_age_s(self) -> float | None: ...
    @property
    def in_doubt_transactions(self) -> int: ...
    @property
    def transactions_rolled_back(self) -> int: ...


class _DualWriterLike(Protocol):
    """What :meth:`Telemetry.instrument_dual_writer` uses of one writer (a ``DualWriter``, a pool's slot)."""

    _step_observers: list[Callable[[Any, Any], None]]

    @property
    def transactional_id(self) -> str: ...
    def metrics(self) -> _DualWriteMetricsLike: ...


_W = TypeVar("_W")
"""``DualWriter``, ``WriterPool``, ``AsyncDualWriter`` or ``AsyncWriterPool``."""


@runtime_checkable
class _SinkLike(Protocol):
    """What :meth:`Telemetry.instrument_spark_sink` uses of ``kafka2pc.recipes.spark_sink.KafkaTwoPhaseSink``."""

    @property
    def sink_id(self) -> str | None: ...
    @property
    def last_batch_metrics(self) -> Any: ...
    def __call__(self, df: DataFrame, batch_id: int) -> None: ...


class _BatchSourceLike(Protocol):
    """What :meth:`Telemetry.instrument_spark_sink` uses of ``kafka2pc.recipes.spark.DataSourceMonitor``."""

    @property
    def sink_id(self) -> str | None: ...
    def add_batch_listener(self, callback: Callable[[Any], None]) -> None: ...


_S = TypeVar("_S", bound="_SinkLike | _BatchSourceLike")

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
    """The sync writer or pool (an asyncio one's ``_sync``)."""
    attributes: dict[str, str]
    snapshot: Callable[[Any], _DualWriteMetricsLike]
    """The writer's (or the pool's summed) :class:`DualWriteMetrics` snapshot."""
    seen: dict[str, int] = field(default_factory=dict)
    slots: weakref.WeakKeyDictionary[Any, _SlotTrack] = field(default_factory=weakref.WeakKeyDictionary)
    """Per writer (a pool's retired slots drop out with their writers)."""

    def metrics(self) -> _DualWriteMetricsLike | None:
        target = self.writer()
        return None if target is None else self.snapshot(target)

    def slot(self, writer: _DualWriterLike) -> _SlotTrack:
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
    sink: _SinkLike | _BatchSourceLike
    open_since: float | None = None
    counted: deque[int] = field(default_factory=lambda: deque(maxlen=1000))
    """Batch ids whose commits were counted: a replay in the same process does not count them again."""

    @property
    def attributes(self) -> dict[str, str]:
        return {COMPONENT: "spark_sink", SINK_ID: self.sink.sink_id or ""}
