"""Exactly-once Kafka writes from Spark, by two-phase commit: ``format("kafka2pc")`` and a ``foreachBatch`` sink.

On PySpark 4, write with ``format("kafka2pc")`` (batch and streaming, Spark's
Kafka sink's options and columns): see :mod:`kafka2pc.recipes.spark.datasource`
and :func:`register_data_source`.  The ``foreachBatch`` sink below works on
every supported line, PySpark 3.5 included; both drive one protocol
(``_protocol``).

The package is laid out by role: ``_values`` (decisions, results, metrics,
named steps), ``_store`` (decision stores), ``_executor`` (the tasks that write
and prepare), ``_protocol`` (the coordinator both paths drive), ``_driver``
(the ``foreachBatch`` sink), ``datasource`` (``format("kafka2pc")``),
``_session`` (what the driver asks Spark) and ``_faults`` (a task hook for tests).

Spark's built-in Kafka sink is at-least-once: when a micro-batch is replayed
(driver restart, task retry) its rows are written again.  This sink writes
every row exactly once.  Use it as a ``foreachBatch`` function::

    from . import KafkaTwoPhaseSink

    sink = KafkaTwoPhaseSink({"bootstrap.servers": "broker:9092"}, topic="out")
    query = (df.selectExpr("CAST(id AS STRING) AS key", "payload AS value")
               .writeStream.foreachBatch(sink)
               .option("checkpointLocation", "hdfs:///checkpoints/q1")
               .start())

Input columns are those of Spark's Kafka sink: ``value`` (required, string or
binary), ``key`` (string or binary), ``topic`` (string; the ``topic`` option
overrides it, as in Spark), ``partition`` (int) and ``headers``
(``array<struct<key: string, value: binary>>``).

The protocol (Spark's driver is the coordinator, one Kafka transaction per
partition of the micro-batch is a participant):

1. *Settle leftovers.*  Every transaction still open under this sink's
   transactional ids (a crashed run's, a zombie task's) is settled with the
   last durable decision: committed if the decision names it, aborted
   otherwise.  Nothing new is written before that.
2. *Replay check.*  If a decision for this batch id is already durable (the
   driver died after deciding), the batch is not written again: the decision
   is completed (step 5) and the batch is done.
3. *Write and prepare* (executors).  Each partition's rows are produced in one
   transaction under the transactional id ``<prefix><sink id>-<partition>``
   and prepared (flushed); the task returns the :class:`~kafka2pc.PreparedTxnState`.
4. *Decide.*  The driver collects the states of the successful task attempts
   and writes the decision ``batch id -> states`` durably (atomic create of a
   new file under the query's checkpoint location) -- the commit point.
5. *Complete.*  The driver commits every named transaction through the
   coordinator (commit only an open
   transaction whose producer id and anchor offset match the recorded state,
   abort anything else), waits for the commit markers, aborts every other
   open transaction of the sink, and records metrics.  A recorded
   transaction that Kafka aborted meanwhile (a late speculative attempt
   re-initialised its id, or the transaction timed out) is *repaired*: that
   partition is written again, the decision gets a new revision naming the
   new state, and it is completed.  Since an aborted
   transaction can never commit, the rows still land exactly once.

Why retries and speculation are safe, and the storage requirements for the
decisions, are explained in ``docs/spark.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._driver import DEFAULT_PREFIX, KafkaTwoPhaseSink
from ._executor import TaskHook, TaskPoint, TaskStep, WriterSpec, write_partition
from ._faults import FaultInjection
from ._store import DecisionStore, HadoopDecisionStore, LocalDecisionStore
from ._values import (
    BatchMetrics,
    PartitionResult,
    SinkCompletionError,
    SinkDecision,
    SinkRepairError,
    SinkStep,
    SinkTransaction,
    SinkWriteError,
    StepHook,
    UnknownTopicError,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def register_data_source(spark: SparkSession) -> None:
    """Register ``format("kafka2pc")`` with ``spark`` (PySpark 4; see :mod:`kafka2pc.recipes.spark.datasource`).

    Example::

        register_data_source(spark)
        df.write.format("kafka2pc").option("kafka.bootstrap.servers", "b:9092").option("topic", "t").save()
    """
    from .datasource import register_data_source as register

    register(spark)


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
    "register_data_source",
    "write_partition",
]
