"""The Spark sink tests share one local SparkSession: the ``spark`` fixture of tests/conftest.py.

Spark is heavy on a small machine, so every in-process test shares one
session (``local[2,4]``: two cores, up to four attempts per task, so task
retries happen), with two shuffle partitions.  No test needs Spark's Kafka
connector: inputs are built in Spark or read from files, outputs are checked
with confluent-kafka.

``format("kafka2pc")`` needs PySpark 4's Python data sources: on older lines
its test modules are not collected (the ``foreachBatch`` sink's are).
"""

from __future__ import annotations

import pyspark

DATA_SOURCE_MODULES = ["test_spark_datasource*.py"]

if int(pyspark.__version__.split(".")[0]) < 4:
    collect_ignore_glob = DATA_SOURCE_MODULES
