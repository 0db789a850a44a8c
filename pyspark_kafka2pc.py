"""PySpark's automatic registration of ``format("kafka2pc")`` (PySpark 4).

PySpark registers the ``DefaultSource`` of every installed module named
``pyspark_*`` when a session first uses a Python data source, so
``df.write.format("kafka2pc")`` works without a call to
:func:`kafka2pc.recipes.spark.register_data_source` (which stays the
documented way, e.g. for a session that looked its data sources up already).
"""

from kafka2pc.recipes.spark._datasource import Kafka2pcDataSource as DefaultSource

__all__ = ["DefaultSource"]
