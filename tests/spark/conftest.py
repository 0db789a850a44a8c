"""The Spark sink tests share one local SparkSession: the ``spark`` fixture of tests/conftest.py.

Spark is heavy on a small machine, so every in-process test shares one
session (``local[2,4]``: two cores, up to four attempts per task, so task
retries happen), with two shuffle partitions.  No test needs Spark's Kafka
connector: inputs are built in Spark or read from files, outputs are checked
with confluent-kafka.

``format("kafka2pc")`` needs PySpark 4's Python data sources.  On an older
line its test modules are left out only when the run says it targets that
line (``KAFKA2PC_SPARK_LINES`` names it, as ``.ci/run``'s PySpark 3.5 step and
``scripts/test-spark.sh`` do); anywhere else their collection fails, with
the import error that names PySpark 4, instead of passing without them.
"""

from __future__ import annotations

import os

import pyspark

DATA_SOURCE_MODULES = ["test_spark_datasource*.py"]

_LINE = ".".join(pyspark.__version__.split(".")[:2])

if int(_LINE.split(".")[0]) < 4 and _LINE in os.environ.get("KAFKA2PC_SPARK_LINES", "").split():
    collect_ignore_glob = DATA_SOURCE_MODULES
