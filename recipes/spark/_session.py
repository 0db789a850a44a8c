"""What the sink asks the driver's SparkSession: classic or Connect, the running query's checkpoint, paths.

A Spark Connect session (``SparkSession.builder.remote(...)``, or the session
a ``foreachBatch`` function gets in the Connect server's worker) has no JVM
handle: ``sparkContext``, ``_jvm`` and ``_jsparkSession`` raise.  What the
sink would ask the JVM (the running query, Hadoop's file systems) has a
JVM-free answer here, or a clear error.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kafka2pc import UsageError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger("kafka2pc.recipes.spark_sink")


def is_connect(spark: SparkSession) -> bool:
    """Is ``spark`` a Spark Connect session (no JVM in this process)?  Asks its class, never the JVM."""
    return type(spark).__module__.startswith("pyspark.sql.connect.")


def master(spark: SparkSession) -> str | None:
    """The session's master URL (``local[2]``, ``spark://...``); ``None`` when a Connect server does not say."""
    if not is_connect(spark):
        return str(spark.sparkContext.master)
    try:
        value = spark.conf.get("spark.master", None)
    except Exception as exc:  # noqa: BLE001 - a server that hides its static settings: unknown
        logger.debug("could not read spark.master from the Connect server: %s", exc)
        return None
    return str(value) if value else None


def running_query_id(spark: SparkSession) -> str | None:
    """The id of the streaming query whose ``foreachBatch`` is calling us (``None`` outside one, or on Connect)."""
    if is_connect(spark):
        return None  # a Connect foreachBatch worker is not told its query
    try:
        query_id = spark.sparkContext.getLocalProperty("sql.streaming.queryId")
    except Exception as exc:  # noqa: BLE001 - an API change in Spark: behave as outside a query
        logger.debug("could not read the running query's id: %s", exc)
        return None
    return str(query_id) if query_id else None


def running_query_checkpoint(spark: SparkSession) -> str | None:
    """The resolved checkpoint root of the streaming query calling us (``None`` outside one, or on Connect)."""
    if is_connect(spark):
        return None
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
    """``location`` as a fully qualified Hadoop URI (``file:/...``, ``hdfs://nn/...``).

    On Spark Connect (no JVM) only a local path or ``file:`` URI qualifies, as
    Hadoop's local file system would qualify it (``file:/abs/path``, so a query
    keeps its sink id when it moves between a classic and a Connect session);
    any other scheme is a :class:`~kafka2pc.UsageError`.
    """
    if is_connect(spark):
        return local_uri(location)
    path = jvm(spark).org.apache.hadoop.fs.Path(location)
    fs = path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    return str(fs.makeQualified(path).toString())


def local_uri(location: str) -> str:
    """A local path or ``file:`` URI as Hadoop's local file system qualifies it: ``file:/abs/path``."""
    import os
    import re

    if location.startswith("file:"):
        path = local_path(location)
    elif re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", location):
        raise UsageError(
            f"{location!r}: on Spark Connect the sink has no JVM to reach Hadoop file systems: use a checkpoint "
            "location on a file system the Connect server mounts (a local path or file: URI, e.g. a mounted "
            "volume), or pass decision_store=..."
        )
    else:
        path = location
    return "file:" + os.path.abspath(os.path.expanduser(path))


def local_path(uri: str) -> str:
    """The local file system path of a ``file:`` URI."""
    from urllib.parse import unquote, urlparse

    return unquote(urlparse(uri).path)
