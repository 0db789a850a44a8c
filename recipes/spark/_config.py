"""What the driver derives from the user's options: the batch's columns and the executors' producer settings.

Pure functions (the broker's ``transaction.max.timeout.ms`` is looked up by the caller).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kafka2pc import TransactionAdmin, UsageError

DELIVERY_REPORTS_CONFIG = "kafka2pc.delivery.reports"
"""The producer setting choosing which delivery reports reach Python (see :class:`kafka2pc.TwoPhaseCommitProducer`)."""

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

_ALLOWED_COLUMNS = {
    "value": {"string", "binary"}, "key": {"string", "binary"}, "topic": {"string"},
    "partition": {"int"}, "headers": {"array<struct<key:string,value:binary>>"},
}


def batch_columns(df: DataFrame, topic: str | None) -> tuple[str, ...]:
    """The columns of Spark's Kafka sink that ``df`` has, checked; ``topic`` (the option) drops the column."""
    return schema_columns(df.schema, topic)


def schema_columns(schema: StructType, topic: str | None) -> tuple[str, ...]:
    """The columns of Spark's Kafka sink that ``schema`` has, checked, with Spark's Kafka sink's errors."""
    fields = {f.name: f.dataType.simpleString() for f in schema.fields}
    if "value" not in fields:
        raise UsageError(f"required attribute 'value' not found: the batch has no 'value' column "
                         f"(columns: {sorted(fields)})")
    columns = []
    for name, types in _ALLOWED_COLUMNS.items():
        if name not in fields:
            continue
        if fields[name] not in types:
            raise UsageError(f"column {name!r} has type {fields[name]}; expected one of {sorted(types)}")
        if name == "topic" and topic is not None:
            continue  # the option overrides the column, as in Spark's Kafka sink
        columns.append(name)
    if topic is None and "topic" not in fields:
        raise UsageError("topic option required when no 'topic' attribute is present: the batch has no "
                         "'topic' column and no topic option is set")
    return tuple(columns)


def default_transaction_timeout_ms(limit_ms: int | None) -> int:
    """The largest transaction timeout the cluster allows a producer, 15 min if unknown.

    ``limit_ms`` is :meth:`kafka2pc.TransactionAdmin.max_transaction_timeout_s`, in milliseconds:
    the broker's ``transaction.max.timeout.ms`` within librdkafka's limit
    (above 2**31 µs librdkafka's request deadlines wrap around).
    """
    return limit_ms if limit_ms else TransactionAdmin.DEFAULT_MAX_TRANSACTION_TIMEOUT_MS


def executor_config(config: Mapping[str, Any], txn_timeout_ms: int | None) -> dict[str, Any]:
    """The executors' producer settings: the user's, plus the sink's defaults where the user set none."""
    result = dict(config)
    # Only failed deliveries reach the tasks' Python: a success report per record
    # costs CPU the task needs for producing (benchmarks/bench_spark_task.py); the
    # prepared state's anchor is asked of the partition leader instead, one
    # request per transaction.
    result.setdefault(DELIVERY_REPORTS_CONFIG, "errors")
    if "transaction.timeout.ms" not in result and "transaction.two.phase.commit.enable" not in result:
        if txn_timeout_ms is not None:
            result["transaction.timeout.ms"] = txn_timeout_ms
    # Every task opens a fresh producer, so init_transactions is on every
    # task's path.  With sparse connections librdkafka drops the bootstrap
    # connection once metadata names the broker and often reaches the
    # coordinator only on its 500 ms retry timer (measured: 55-510 ms per
    # init); with eager connections it takes 3-5 ms.  socket.timeout.ms
    # follows the transaction timeout (found while a 1 h timeout still made
    # librdkafka's requests time out at once; the cap above is the cure).
    if "enable.sparse.connections" not in result:
        result["enable.sparse.connections"] = False
        if "socket.timeout.ms" not in result:
            txn_timeout = int(result.get("transaction.timeout.ms", 60_000))
            result["socket.timeout.ms"] = max(1_000, min(60_000, txn_timeout - 100))
    return result
