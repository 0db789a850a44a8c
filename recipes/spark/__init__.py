"""Exactly-once Kafka writes from Spark, by two-phase commit: ``format("kafka2pc")`` and a ``foreachBatch`` sink.

On PySpark 4, write with ``format("kafka2pc")`` (batch and streaming, Spark's
Kafka sink's options and columns): see :func:`register_data_source` and
:func:`recover`.  The ``foreachBatch`` sink below works on every supported
line, PySpark 3.5 included; both drive one protocol (``_protocol``).  Every
public name of both paths is importable from this package.

The package is laid out by role: ``_values`` (decisions, results, metrics,
named steps), ``_store`` (decision stores), ``_executor`` (the tasks that write
and prepare), ``_protocol`` (the coordinator both paths drive), ``_driver``
(the ``foreachBatch`` sink), ``_datasource`` (``format("kafka2pc")``),
``_options`` (its options and :func:`recover`), ``_relay`` (its driver-side
logs and metrics), ``_session`` (what the driver asks Spark) and ``_faults``
(a task hook for kafka2pc's own tests).

Spark's built-in Kafka sink is at-least-once: when a micro-batch is replayed
(driver restart, task retry) its rows are written again.  This sink writes
every row exactly once.  Use it as a ``foreachBatch`` function::

    from kafka2pc.recipes.spark import KafkaTwoPhaseSink

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

from ._driver import KafkaTwoPhaseSink
from ._options import DEFAULT_PREFIX, recover
from ._relay import DataSourceMonitor
from ._store import DecisionStore, HadoopDecisionStore, LocalDecisionStore
from ._values import (
    BatchMetrics,
    PartitionResult,
    SinkCompletionError,
    SinkDecision,
    SinkRecovery,
    SinkRepairError,
    SinkStep,
    SinkStepHook,
    SinkTransaction,
    SinkWriteError,
    UnknownTopicError,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_RENAMED = {"StepHook": "SinkStepHook"}
"""Old names that still work, with a ``DeprecationWarning``, until kafka2pc 2.0."""


def __getattr__(name: str) -> object:
    if name in _RENAMED:
        import warnings

        warnings.warn(f"kafka2pc.recipes.spark.{name} is deprecated: use {_RENAMED[name]} (the dual-write "
                      "recipe's StepHook is another type)", DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_data_source(spark: SparkSession) -> DataSourceMonitor:
    """Register ``format("kafka2pc")`` with ``spark`` for this Python thread (PySpark 4); return the monitor.

    Call it once per session, and, on a classic session, in every other
    Python thread that writes with ``format("kafka2pc")``: PySpark looks
    Python data sources up through the JVM's active session, which is per
    thread (a thread that did not call it gets ``DATA_SOURCE_NOT_FOUND``).  A
    Spark Connect session (``SparkSession.builder.remote(...)``) is accepted
    too; there the registration belongs to the server-side session, so every
    client thread using ``spark`` finds it.  The registered source sends its
    driver-side log records to this process's ``logging`` and each batch's
    :class:`BatchMetrics` to the returned :class:`DataSourceMonitor` (on
    Connect, when the server runs on this host; see ``docs/spark-connect.md``).

    Example::

        register_data_source(spark)
        df.write.format("kafka2pc").option("kafka.bootstrap.servers", "b:9092").option("topic", "t").save()
    """
    from ._datasource import register_data_source as register

    return register(spark)


__all__ = [
    "DEFAULT_PREFIX",
    "BatchMetrics",
    "DataSourceMonitor",
    "DecisionStore",
    "HadoopDecisionStore",
    "KafkaTwoPhaseSink",
    "LocalDecisionStore",
    "PartitionResult",
    "SinkCompletionError",
    "SinkDecision",
    "SinkRecovery",
    "SinkRepairError",
    "SinkStep",
    "SinkStepHook",
    "SinkTransaction",
    "SinkWriteError",
    "UnknownTopicError",
    "recover",
    "register_data_source",
]
