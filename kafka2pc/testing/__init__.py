"""Real-service helpers for testing applications built on kafka2pc.

- :mod:`kafka2pc.testing.broker` — a real Apache Kafka broker (KRaft) on loopback,
  fetched from Maven Central: ``python -m kafka2pc.testing.broker up``.
- :func:`drain` — read every record of a topic as a ``read_committed`` or
  ``read_uncommitted`` consumer.
- :func:`end_offsets` — high watermark and last stable offset of each partition;
  :func:`settled_end_offsets` — the last stable offsets once no transaction is being
  completed; :func:`wait_for_open_records` — until an open transaction's record is on a topic.
- :mod:`kafka2pc.testing.pytest_plugin` — pytest fixtures (``kafka_bootstrap``,
  ``topic_factory``, ``pg_url``, ``pg_engine``, ``sqlite_engine``); enable them with
  ``pytest_plugins = ["kafka2pc.testing.pytest_plugin"]`` in your ``conftest.py``.

A fixture whose service cannot start makes the test *fail*, never skip.
"""

from kafka2pc.testing._kafka import (
    Record,
    create_topic,
    drain,
    end_offsets,
    settled_end_offsets,
    wait_for_open_records,
)

__all__ = ["Record", "create_topic", "drain", "end_offsets", "settled_end_offsets", "wait_for_open_records"]
