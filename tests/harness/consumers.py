"""Consumers of the consume-transform-produce tests: an assignment that starts at the group's committed offsets.

``Consumer.assign()`` without an offset makes librdkafka fetch the committed
offsets itself, and an OffsetFetch that fails as a whole (``NOT_COORDINATOR``
or ``COORDINATOR_LOAD_IN_PROGRESS`` with no partitions, as a fresh broker
answers while it loads ``__consumer_offsets``) is never retried: the partition
is not fetched at all (librdkafka issue #5586).  :func:`assign_at_committed`
reads the committed offsets with ``Consumer.committed()``, which fails within
its timeout and is retried here, and assigns those offsets explicitly.
"""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition


def assign_at_committed(consumer: Any, partitions: list[TopicPartition], timeout_s: float = 60.0) -> list[int]:
    """Assign ``partitions`` at the consumer group's committed offsets (the start where none is); return them.

    Raises ``TimeoutError`` naming the last error when the group's coordinator
    does not answer within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            committed = consumer.committed(partitions, timeout=min(10.0, max(0.1, deadline - time.monotonic())))
            break
        except KafkaException as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the committed offsets of {partitions} were not read in {timeout_s}s: {exc}") from exc
            time.sleep(0.2)
    offsets = [tp.offset if tp.offset >= 0 else OFFSET_BEGINNING for tp in committed]
    consumer.assign([TopicPartition(tp.topic, tp.partition, offset) for tp, offset in zip(committed, offsets)])
    return offsets
