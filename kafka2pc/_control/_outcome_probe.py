"""Was one record committed?  Asked of a ``read_committed`` librdkafka consumer.

Below the last stable offset every transaction is decided, and the question
is whether a ``read_committed`` reader sees the record.  Filtering aborted
records needs the fetch response's aborted-transaction index applied to the
record batches; librdkafka's implementation of that is the one the
application's own readers use, so the answer matches what they see.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from kafka2pc._control._retry import Deadline
from kafka2pc._errors import translate_confluent_error
from kafka2pc._exceptions import UsageError
from kafka2pc._logging import with_librdkafka_logger
from kafka2pc._types import TopicPartition

__all__ = ["read_committed_outcome"]

_POLL_S = 0.5


def read_committed_outcome(
    librdkafka_connection: Mapping[str, Any], tp: TopicPartition, offset: int, deadline: Deadline, context: str
) -> str:
    """``"committed"``, ``"aborted"`` or ``"unknown"`` for the record at ``tp``/``offset``.

    A short-lived consumer (``isolation.level=read_committed``, assigned at
    ``offset``, no group membership, no commits): the first record it returns
    decides: offset ``offset`` -> committed; a later offset, or reaching the
    last stable offset (partition EOF) first -> aborted; the offset deleted
    meanwhile -> unknown.  Raises :class:`BrokerUnavailableError` when no
    answer comes before ``deadline``.
    """
    from confluent_kafka import Consumer, KafkaError, KafkaException
    from confluent_kafka import TopicPartition as ConfluentTopicPartition

    config = dict(librdkafka_connection)
    config.update(
        {
            "group.id": f"kafka2pc-outcome-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "auto.offset.reset": "error",
            "fetch.max.bytes": 1_048_576,
        }
    )
    with_librdkafka_logger(config)  # librdkafka's logs -> logging (kafka2pc._logging)
    try:
        consumer = Consumer(config)
    except KafkaException as exc:
        raise UsageError(f"{context}: cannot create the outcome consumer: {exc}") from exc
    try:
        consumer.assign([ConfluentTopicPartition(tp.topic, tp.partition, offset)])
        while (remaining := deadline.remaining()) > 0:
            message = consumer.poll(min(remaining, _POLL_S))
            if message is None:
                continue
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    return "aborted"
                if error.code() == KafkaError._AUTO_OFFSET_RESET:
                    return "unknown"  # deleted between ListOffsets and the fetch
                if error.fatal() or not error.retriable():
                    raise translate_confluent_error(error, context)
                continue
            found = message.offset()
            if found is None or found < offset:
                continue
            return "committed" if found == offset else "aborted"
    finally:
        consumer.close()
    raise deadline.exceeded(context, "no answer from a read_committed fetch")
