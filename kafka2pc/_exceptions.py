"""The kafka2pc exception hierarchy.

Every error kafka2pc raises derives from :class:`Kafka2pcError`. Errors from the
libraries underneath (confluent-kafka's ``KafkaException``, kafka-python's
``KafkaError``) are translated in one place (:func:`kafka2pc._errors.translate`)
and chained with ``raise ... from exc``::

    Kafka2pcError
    ├── KafkaTransactionError          runtime: something the cluster said or did
    │   ├── RetriableError             try the same call again
    │   │   ├── BrokerUnavailableError     no broker / coordinator reachable in time
    │   │   └── QueueFullError             the producer's local queue is full (also a BufferError)
    │   ├── AbortableError             the open transaction must be aborted
    │   ├── FatalError                 this producer instance is unusable
    │   │   ├── ProducerFencedError        a newer instance owns the transactional id
    │   │   ├── AuthorizationError         missing ACL (e.g. TRANSACTIONAL_ID_AUTHORIZATION_FAILED)
    │   │   └── UnsupportedBrokerError     broker lacks an API or refuses 2PC
    │   ├── IndefiniteOutcomeError     the outcome of a commit/abort is not known yet
    │   └── HeuristicOutcomeError      Kafka settled the transaction against the caller's decision
    └── UsageError                     misuse: nothing was sent
        ├── IllegalStateError              call not allowed in the producer's current state
        ├── InvalidPreparedStateError      malformed PreparedTxnState text (also a ValueError)
        ├── TransactionalIdMismatchError   state belongs to another transactional id
        └── UnknownTopicError              a record (or a sink's option) names a topic that does not exist
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AbortableError",
    "AuthorizationError",
    "BrokerUnavailableError",
    "FatalError",
    "HeuristicOutcomeError",
    "IllegalStateError",
    "IndefiniteOutcomeError",
    "InvalidPreparedStateError",
    "Kafka2pcError",
    "KafkaTransactionError",
    "ProducerFencedError",
    "QueueFullError",
    "RetriableError",
    "TransactionalIdMismatchError",
    "UnknownTopicError",
    "UnsupportedBrokerError",
    "UsageError",
]


class Kafka2pcError(Exception):
    """Base class of every error raised by kafka2pc."""


class KafkaTransactionError(Kafka2pcError):
    """A runtime failure reported by (or while talking to) the Kafka cluster.

    ``error_name`` is the broker's wire name (e.g. ``"CONCURRENT_TRANSACTIONS"``)
    when one is known, ``error_code`` its numeric code.
    """

    def __init__(
        self,
        message: str,
        *,
        error_name: str | None = None,
        error_code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.error_name = error_name
        self.error_code = error_code


class RetriableError(KafkaTransactionError):
    """A transient failure: the same call may be retried."""


class BrokerUnavailableError(RetriableError):
    """No broker (or no transaction coordinator) answered within the timeout."""


class QueueFullError(RetriableError, BufferError):
    """The producer's local queue is full: call ``poll()`` and retry (also a ``BufferError``).

    ``queued`` is how many records of the call were queued before the queue
    stayed full (:meth:`TwoPhaseCommitProducer.produce_batch`; 0 for ``produce``).
    """

    def __init__(
        self, message: str, *, queued: int = 0, error_name: str | None = None, error_code: int | None = None
    ) -> None:
        super().__init__(message, error_name=error_name, error_code=error_code)
        self.queued = queued


class AbortableError(KafkaTransactionError):
    """The current transaction cannot commit; abort it and start again."""


class FatalError(KafkaTransactionError):
    """The producer instance cannot continue; close it and create a new one."""


class ProducerFencedError(FatalError):
    """Another instance with the same ``transactional.id`` has taken over."""


class AuthorizationError(FatalError):
    """The principal lacks an ACL (transactional id, cluster, topic or TWO_PHASE_COMMIT)."""


class UnsupportedBrokerError(FatalError):
    """The broker does not support an API or feature that was asked for."""


class IndefiniteOutcomeError(KafkaTransactionError):
    """A commit or abort was sent but its outcome is unknown (e.g. it timed out).

    The producer refuses to start a new transaction until the outcome is
    settled: call :meth:`TwoPhaseCommitProducer.complete_transaction` with the
    prepared state (or retry the same call).  ``state`` is that prepared state.
    """

    def __init__(self, message: str, *, state: Any = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.state = state


class HeuristicOutcomeError(KafkaTransactionError):
    """Kafka settled a prepared transaction differently from the caller's decision.

    The typical case: the database committed, but the broker aborted the
    Kafka transaction (transaction timeout, or an operator force-terminated
    it).  In 2PC terms this is a *heuristic rollback*; it must be reported,
    never hidden.  ``transactional_id``, ``state`` (the prepared state the
    caller asked to commit) and ``outcome`` (what Kafka did: ``"aborted"``)
    say exactly what happened.
    """

    def __init__(
        self,
        message: str,
        *,
        transactional_id: str,
        state: Any,
        outcome: str,
        **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        self.transactional_id = transactional_id
        self.state = state
        self.outcome = outcome


class UsageError(Kafka2pcError):
    """The call itself is wrong; nothing was sent to the cluster."""


class IllegalStateError(UsageError):
    """The call is not allowed in the producer's current transaction state."""


class ForkedProcessError(UsageError):
    """The object was made in another process: it was inherited through ``fork()``.

    confluent-kafka's producers, SQLAlchemy's pooled connections and background threads do not
    survive a fork. An object that cannot be remade in the child raises this at its first use
    there, at once, and sends nothing; make it after the fork instead (gunicorn's ``post_worker_init``,
    Celery's ``worker_process_init``, uWSGI's ``postfork``). ``pid`` is the process that made it.
    """

    def __init__(self, message: str, *, pid: int) -> None:
        super().__init__(message)
        self.pid = pid


class InvalidPreparedStateError(UsageError, ValueError):
    """A ``PreparedTxnState`` string is malformed."""


class TransactionalIdMismatchError(UsageError):
    """A prepared state was produced under a different ``transactional.id``."""


class UnknownTopicError(UsageError):
    """A record (or a Spark sink's ``topic`` option) names a topic that does not exist, and the cluster
    does not create topics automatically; ``topic`` names it (``None`` when unknown).

    Kafka's ``UNKNOWN_TOPIC_OR_PARTITION``.  The dual-write recipe raises it
    from ``tx.produce`` before anything is sent; the Spark sinks before a
    batch starts.  ``kafka2pc.recipes.dual_write.TopicNotFoundError`` is its
    deprecated rc1 name.
    """

    def __init__(self, message: str, topic: str | None = None) -> None:
        super().__init__(message)
        self.topic = topic
