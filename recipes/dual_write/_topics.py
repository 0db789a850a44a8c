"""Fail fast, naming the topic, when a record is produced to a topic that does not exist.

Without the check librdkafka keeps the record queued until the prepare's
flush gives up (``message.timeout.ms``), ~30 s or more later, with an error
that does not name the topic.  One metadata request per topic and writer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final

from kafka2pc import UnknownTopicError

LIBRDKAFKA_LOGGER: Final = "kafka2pc.librdkafka"
"""The logger kafka2pc's producers give librdkafka (``kafka2pc._logging.LIBRDKAFKA_LOGGER_NAME``)."""

__all__ = ["DEFAULT_TOPIC_CHECK_TIMEOUT_S", "TopicCheck"]

DEFAULT_TOPIC_CHECK_TIMEOUT_S: Final = 10.0
"""How long a new topic's metadata request waits, unless the writer's ``kafka_timeout_s`` bounds it."""

logger = logging.getLogger(__name__)

_CONNECTION_KEYS: Final = ("bootstrap.servers", "client.id", "client.dns.lookup", "client.rack")
_CONNECTION_PREFIXES: Final = ("security.", "sasl.", "ssl.", "socket.", "broker.", "reconnect.", "oauthbearer.")


class TopicCheck:
    """Remembers the topics known to exist; asks the cluster (bounded) about a new one."""

    def __init__(
        self, producer_config: Mapping[str, Any], timeout_s: float = DEFAULT_TOPIC_CHECK_TIMEOUT_S,
        blocking: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> None:
        """``blocking`` runs the metadata request (the writer's runtime: in an event loop, off the loop)."""
        self._config = {
            k: v for k, v in producer_config.items() if k in _CONNECTION_KEYS or k.startswith(_CONNECTION_PREFIXES)
        }
        self._timeout_s = timeout_s
        self.known: set[str] = set()
        """Topics the cluster said exist (the caller may test membership before :meth:`require`)."""
        self._admin: Any = None
        self._lock = threading.Lock()
        self._blocking = blocking

    def require(self, topic: str, transactional_id: str) -> None:
        """Raise :class:`~kafka2pc.UnknownTopicError` if the cluster says ``topic`` does not exist."""
        if topic in self.known:
            return
        if self._blocking is None:
            self._require(topic, transactional_id)
        else:
            self._blocking(lambda: self._require(topic, transactional_id))

    def _require(self, topic: str, transactional_id: str) -> None:
        from confluent_kafka import KafkaError, KafkaException
        from confluent_kafka.admin import AdminClient

        with self._lock:
            if self._admin is None:
                config = dict(self._config)
                # librdkafka's logs -> logging, on the logger (and its filter) the writer's producer set up
                config.setdefault("logger", logging.getLogger(LIBRDKAFKA_LOGGER))
                self._admin = AdminClient(config)
            try:
                metadata = self._admin.list_topics(topic, timeout=self._timeout_s)
            except KafkaException as exc:  # the cluster did not answer: let the producer report it
                logger.debug("%s: metadata of topic %r not available (%s)", transactional_id, topic, exc)
                return
        found = metadata.topics.get(topic)
        error = getattr(found, "error", None)
        if found is None or (error is not None and error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
            raise UnknownTopicError(
                f"{transactional_id!r}: topic {topic!r} does not exist (and the cluster does not create topics "
                "automatically): create it first, e.g. kafka-topics.sh --create --topic " + topic,
                topic,
            )
        self.known.add(topic)
