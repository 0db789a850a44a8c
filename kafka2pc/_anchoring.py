"""How a prepared state comes to name exactly one transaction: its anchor (see :mod:`kafka2pc._state`).

The first delivered record anchors a transaction with records (free: the
delivery reports carry its offset).  With ``kafka2pc.delivery.reports=errors``
no success report says it, so the leaders of the partitions the transaction
wrote are asked (DescribeProducers).  A transaction with only consumer offsets
gets a marker record in the anchor topic at prepare time, because the
offset-commit record the group coordinator writes to the compacted
``__consumer_offsets`` would be removed by compaction and then read as aborted
by the outcome probe.  A transaction that sent nothing says so.

:class:`Anchoring` is that collaborator of :class:`~kafka2pc.TwoPhaseCommitProducer`:
it owns the open transaction's anchor (and what it needs to find one: where
the transaction wrote, whether it sent offsets, its first delivery error),
and takes the steps ``produce`` and ``prepare_transaction`` need to fill it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message

from kafka2pc._calls import LibrdkafkaCalls, bounded
from kafka2pc._control import ControlPlane
from kafka2pc._deadline import time_left
from kafka2pc._errors import kafka_error_of, translate_confluent_error
from kafka2pc._exceptions import AbortableError, FatalError, QueueFullError, RetriableError
from kafka2pc._logging import with_librdkafka_logger
from kafka2pc._machine import StateMachine, TxnState
from kafka2pc._producer_config import ANCHOR_TOPIC_CONFIG, ANCHOR_TOPIC_PARTITIONS
from kafka2pc._types import TopicAndPartition

__all__ = ["Anchoring"]

logger = logging.getLogger("kafka2pc._producer")  # one logger name for the producer's modules


class Anchoring:
    """The anchor of the open transaction's prepared state (a collaborator of the producer)."""

    def __init__(
        self,
        *,
        transactional_id: str,
        machine: StateMachine,
        calls: LibrdkafkaCalls,
        ctrl: ControlPlane,
        librdkafka: dict[str, Any],
        errors_only: bool,
        anchor_topic: str,
    ) -> None:
        self._transactional_id = transactional_id
        self._machine = machine
        self._calls = calls
        self._ctrl = ctrl
        self._config = librdkafka
        self._errors_only = errors_only
        """``kafka2pc.delivery.reports=errors``: no success report, the anchor is asked of the leaders."""
        self._anchor_topic = anchor_topic
        self._anchor_topic_checked = False
        self._anchor: tuple[str, int, int] | None = None
        """``(topic, partition, offset)`` of the transaction's first delivered record."""
        self._written: dict[str, set[int] | None] = {}
        """With ``kafka2pc.delivery.reports=errors``: topic -> the partitions written (``None``: any)."""
        self._offsets_sent = False
        self._marker_queued = False
        self._delivery_error: KafkaError | None = None

    def reset(self) -> None:
        """Forget the last transaction's anchor (``begin_transaction``)."""
        self._anchor = None
        self._written = {}
        self._offsets_sent = False
        self._marker_queued = False
        self._delivery_error = None

    def note_offsets_sent(self) -> None:
        """The transaction holds consumer offsets (it may need a marker record to be anchored)."""
        self._offsets_sent = True

    def note_written(self, topic: str, partition: int | None) -> None:
        """Remember where the transaction wrote (``kafka2pc.delivery.reports=errors`` finds its anchor there)."""
        known = self._written.get(topic, set())
        if known is None:
            return
        if partition is None or partition < 0:
            self._written[topic] = None
        else:
            known.add(partition)
            self._written[topic] = known

    def delivery_callback(self, user_cb: Callable[..., Any] | None) -> Callable[[KafkaError | None, Message], None]:
        """A delivery callback that records the anchor (or the first failure), then calls ``user_cb``."""
        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                if self._delivery_error is None:
                    self._delivery_error = err
            elif self._anchor is None:
                # Delivery reports of one partition arrive in offset order: the first
                # one on any partition is the transaction's first record there.
                topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
                if topic is not None and partition is not None and offset is not None:
                    self._anchor = (topic, partition, offset)
            if user_cb is not None:
                user_cb(err, msg)

        return on_delivery
    def flush_for_prepare(self, deadline: float) -> None:
        """Deliver every record of the transaction by ``deadline``, with the marker record an offsets-only one needs.

        Raises the first delivery error (abortable or fatal), or
        :class:`RetriableError` when records are still in flight at ``deadline``.
        """
        self._flush(max(deadline - time.monotonic(), 0.0))
        if self._anchor is None and self._offsets_sent and not self._marker_queued:
            self._queue_marker(deadline)
            self._flush(max(deadline - time.monotonic(), 0.0))

    def anchor(self, deadline: float, producer_id: int, epoch: int) -> tuple[str, int, int] | None:
        """The delivered transaction's anchor, asked of the leaders by ``deadline`` if no report gave it.

        ``None`` for a transaction that sent nothing.  ``producer_id`` and
        ``epoch`` name this producer in the leaders' answers.
        """
        if self._anchor is None and self._written:
            self._anchor = self._find_anchor(deadline, producer_id, epoch)
        if self._anchor is None and self._offsets_sent:  # pragma: no cover - a delivered marker sets the anchor
            raise FatalError(f"prepare_transaction({self._transactional_id!r}): the marker record has no offset")
        return self._anchor

    def _find_anchor(self, deadline: float, producer_id: int, epoch: int) -> tuple[str, int, int]:
        """The first offset of this transaction on a partition it wrote, asked of the partition leaders.

        With ``kafka2pc.delivery.reports=errors`` no successful delivery report
        says it.  After the flush every record is written; the leader of each
        partition the transaction wrote reports its start offset there
        (DescribeProducers' ``CurrentTxnStartOffset`` for this producer id and
        epoch), which is exactly what the first delivery report would have
        said.  One request per partition, in the order the transaction first
        wrote each topic, until one answers.
        """
        op = "prepare_transaction"
        for topic, partitions in self._written.items():
            asked: set[int] = set()
            if partitions is None:
                # Partition 0 always exists and, for keyed records, was most likely written:
                # ask it before spending a metadata request on the topic's partition count.
                offset = self._txn_start_offset(TopicAndPartition(topic, 0), deadline, producer_id, epoch)
                if offset is not None:
                    return topic, 0, offset
                asked.add(0)
                left = time_left(deadline, op)
                try:
                    metadata = self._calls.require().list_topics(topic, timeout=left)
                except KafkaException as exc:
                    raise self._calls.failed(op, exc) from exc
                described = metadata.topics.get(topic)
                partitions = set(described.partitions) if described is not None else set()
            for partition in sorted(partitions - asked):
                offset = self._txn_start_offset(TopicAndPartition(topic, partition), deadline, producer_id, epoch)
                if offset is not None:
                    return topic, partition, offset
        # Every record was delivered (no error report), yet no partition has the transaction open:
        # another instance fenced this one, or it was aborted meanwhile.
        error = AbortableError(
            f"{op}({self._transactional_id!r}): no partition the transaction wrote has it open any more "
            f"(producer {producer_id}, epoch {epoch}); it was aborted or fenced: abort and retry"
        )
        self._machine.transition_to(TxnState.ABORTABLE_ERROR, cause=error)
        raise error

    def _txn_start_offset(self, tp: TopicAndPartition, deadline: float, producer_id: int, epoch: int) -> int | None:
        """This producer's open transaction's first offset on ``tp`` (DescribeProducers), if it has one there."""
        with bounded(self._ctrl, deadline, "prepare_transaction"):
            producers = self._ctrl.describe_producers(tp)
        for p in producers:
            mine = p.producer_id == producer_id and p.producer_epoch == epoch
            if mine and p.current_txn_start_offset >= 0:
                return p.current_txn_start_offset
        return None

    def _flush(self, timeout: float) -> None:
        """Flush; raise the first delivery error (abortable or fatal), or RetriableError on timeout."""
        remaining = self._calls.call(lambda p: p.flush(timeout), "prepare_transaction")
        if self._delivery_error is not None:
            failed = translate_confluent_error(
                self._delivery_error, f"prepare_transaction({self._transactional_id!r}): a record failed delivery"
            )
            if isinstance(failed, FatalError):
                # e.g. INVALID_PRODUCER_EPOCH: a recovery elsewhere fenced this instance;
                # "abort and retry" would be wrong advice.
                self._machine.transition_to(TxnState.FATAL_ERROR, cause=failed)
                raise failed
            err = AbortableError(
                f"a record of the transaction failed delivery: {self._delivery_error.str()}",
                error_name=self._delivery_error.name(), error_code=self._delivery_error.code(),
            )
            self._machine.transition_to(TxnState.ABORTABLE_ERROR, cause=err)
            raise err
        if remaining:
            raise RetriableError(f"prepare_transaction: {remaining} records still in flight after {timeout}s")

    def _queue_marker(self, deadline: float) -> None:
        """Produce the marker record that anchors an offsets-only transaction."""
        if not self._anchor_topic_checked:
            self._ensure_anchor_topic(deadline)
        producer = self._calls.require()
        if self._errors_only:
            self.note_written(self._anchor_topic, None)
        try:
            producer.produce(self._anchor_topic, key=self._transactional_id.encode(), value=b"")
        except BufferError as exc:
            raise QueueFullError(str(exc)) from exc
        except KafkaException as exc:
            raise self._calls.failed("prepare_transaction", exc) from exc
        self._marker_queued = True

    def _ensure_anchor_topic(self, deadline: float) -> None:
        """Create the anchor topic if it is missing (once per producer); errors say what to do."""
        topic = self._anchor_topic
        with bounded(self._ctrl, deadline, "prepare_transaction"):
            names = self._ctrl.topic_names()
        if topic in names:
            self._anchor_topic_checked = True
            return
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        from kafka2pc._control import librdkafka_connection_config

        wait = max(deadline - time.monotonic(), 0.1)
        admin = AdminClient(with_librdkafka_logger(librdkafka_connection_config(self._config)))
        new_topic = NewTopic(
            topic, ANCHOR_TOPIC_PARTITIONS, -1, config={"cleanup.policy": "delete"}
        )
        future = admin.create_topics([new_topic], operation_timeout=wait, request_timeout=wait)[topic]
        try:
            future.result(timeout=wait)
        except KafkaException as exc:
            err = kafka_error_of(exc)
            if err is None or err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                cause = translate_confluent_error(exc, "creating the anchor topic")
                error = AbortableError(
                    f"prepare_transaction({self._transactional_id!r}): this transaction holds consumer offsets "
                    f"but no record, so kafka2pc anchors it on a marker record in topic {topic!r} "
                    f"({ANCHOR_TOPIC_CONFIG}), which does not exist and could not be created: {cause}. "
                    f"Create it (cleanup.policy=delete) or grant CREATE on it, and WRITE to this producer; "
                    "then abort this transaction and retry",
                    error_name=getattr(cause, "error_name", None), error_code=getattr(cause, "error_code", None),
                )
                self._machine.transition_to(TxnState.ABORTABLE_ERROR, cause=error)
                raise error from exc
        except Exception as exc:  # concurrent.futures.TimeoutError: no answer in time
            error = AbortableError(
                f"prepare_transaction({self._transactional_id!r}): creating the anchor topic {topic!r} "
                f"({ANCHOR_TOPIC_CONFIG}) got no answer within {wait:.1f}s: {exc!r}; abort and retry"
            )
            self._machine.transition_to(TxnState.ABORTABLE_ERROR, cause=error)
            raise error from exc
        logger.info("%s: created the anchor topic %r for offsets-only transactions", self._transactional_id, topic)
        self._anchor_topic_checked = True

