"""The Spark sink tests share one local SparkSession: the ``spark`` fixture of tests/conftest.py.

Spark is heavy on a small machine, so every in-process test shares one
session (``local[2,4]``: two cores, up to four attempts per task, so task
retries happen), with two shuffle partitions.  No test needs Spark's Kafka
connector: inputs are built in Spark or read from files, outputs are checked
with confluent-kafka.
"""
