"""What the sink asks the driver's SparkSession: the running query's checkpoint, Hadoop paths."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kafka2pc import UsageError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger("kafka2pc.recipes.spark_sink")


def running_query_id(spark: SparkSession) -> str | None:
    """The id of the streaming query whose ``foreachBatch`` is calling us (``None`` outside one)."""
    try:
        query_id = spark.sparkContext.getLocalProperty("sql.streaming.queryId")
    except Exception as exc:  # noqa: BLE001 - an API change in Spark: behave as outside a query
        logger.debug("could not read the running query's id: %s", exc)
        return None
    return str(query_id) if query_id else None


def running_query_checkpoint(spark: SparkSession) -> str | None:
    """The resolved checkpoint root of the streaming query calling us (``None`` outside one)."""
    try:
        query_id = running_query_id(spark)
        if not query_id:
            return None
        from pyspark.sql import SparkSession as _Session

        sessions = [spark, _Session.getActiveSession()]
        for session in sessions:
            if session is None:
                continue
            wrapper = session._jsparkSession.streams().get(query_id)
            if wrapper is not None:
                return str(wrapper.streamingQuery().resolvedCheckpointRoot())
    except Exception as exc:  # noqa: BLE001 - an API change in Spark: fall back to the explicit option
        logger.debug("could not find the running query's checkpoint: %s", exc)
    return None


def jvm(spark: SparkSession) -> Any:
    """The driver's JVM gateway (raises on Spark Connect or a stopped context)."""
    gateway = spark.sparkContext._jvm
    if gateway is None:
        raise UsageError("the SparkContext has no JVM gateway (stopped, or Spark Connect)")
    return gateway


def qualify(spark: SparkSession, location: str) -> str:
    """``location`` as a fully qualified Hadoop URI (``file:/...``, ``hdfs://nn/...``)."""
    path = jvm(spark).org.apache.hadoop.fs.Path(location)
    fs = path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    return str(fs.makeQualified(path).toString())


def local_path(uri: str) -> str:
    """The local file system path of a ``file:`` URI."""
    from urllib.parse import unquote, urlparse

    return unquote(urlparse(uri).path)
