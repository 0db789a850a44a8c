"""Fixtures of the Spark sink tests: one local SparkSession for the whole session.

Spark is heavy on a small machine, so every in-process test shares one
session (``local[2,4]``: two cores, up to four attempts per task, so task
retries happen), with two shuffle partitions.  No test needs Spark's Kafka
connector: inputs are built in Spark or read from files, outputs are checked
with confluent-kafka.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """A local SparkSession shared by the in-process tests."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.pop("K2PC_SPARK_TEST_CRASH", None)
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2,4]")
        .appName("kafka2pc-spark-tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.sql.streaming.minBatchesToRetain", "20")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
