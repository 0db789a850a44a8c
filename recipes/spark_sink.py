"""Exactly-once Kafka sink for Spark Structured Streaming (the names of :mod:`kafka2pc.recipes.spark`).

Kept so that ``from kafka2pc.recipes.spark_sink import KafkaTwoPhaseSink`` works;
the implementation lives in the :mod:`kafka2pc.recipes.spark` package.
"""

from __future__ import annotations

from .spark import (
    DEFAULT_PREFIX,
    BatchMetrics,
    DecisionStore,
    FaultInjection,
    HadoopDecisionStore,
    KafkaTwoPhaseSink,
    LocalDecisionStore,
    PartitionResult,
    SinkCompletionError,
    SinkDecision,
    SinkRepairError,
    SinkStep,
    SinkTransaction,
    SinkWriteError,
    StepHook,
    TaskHook,
    TaskPoint,
    TaskStep,
    UnknownTopicError,
    WriterSpec,
    write_partition,
)
from .spark._executor import WriterSpec as _WriterSpec  # noqa: F401 - its name before the package

__all__ = [
    "DEFAULT_PREFIX",
    "BatchMetrics",
    "DecisionStore",
    "FaultInjection",
    "HadoopDecisionStore",
    "KafkaTwoPhaseSink",
    "LocalDecisionStore",
    "PartitionResult",
    "SinkCompletionError",
    "SinkDecision",
    "SinkRepairError",
    "SinkStep",
    "SinkTransaction",
    "SinkWriteError",
    "StepHook",
    "TaskHook",
    "TaskPoint",
    "TaskStep",
    "UnknownTopicError",
    "WriterSpec",
    "write_partition",
]
