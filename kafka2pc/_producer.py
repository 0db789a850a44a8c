"""``TwoPhaseCommitProducer``: KIP-939's participant API over a confluent-kafka producer.

Every prepared state names exactly one transaction (see :mod:`kafka2pc._state`):
the first delivered record anchors a transaction with records (free: the
delivery reports carry its offset); a transaction with only consumer offsets
gets a marker record in the anchor topic at prepare time, because the
offset-commit record the group coordinator writes to the compacted
``__consumer_offsets`` would be removed by compaction and then read as aborted
by the outcome probe; a transaction that sent nothing says so.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from kafka2pc._control import ControlPlane
from kafka2pc._errors import translate_confluent_error
from kafka2pc._exceptions import (
    AbortableError,
    BrokerUnavailableError,
    FatalError,
    HeuristicOutcomeError,
    IllegalStateError,
    IndefiniteOutcomeError,
    Kafka2pcError,
    RetriableError,
    UnsupportedBrokerError,
    UsageError,
)
from kafka2pc._logging import with_librdkafka_logger
from kafka2pc._machine import StateMachine, TxnState
from kafka2pc._recovery import Settlement, settle
from kafka2pc._state import PreparedTxnState
from kafka2pc._types import TopicAndPartition

__all__ = ["DeliveryCallback", "Headers", "TwoPhaseCommitProducer"]

logger = logging.getLogger(__name__)

DeliveryCallback = Callable[[KafkaError | None, Message], None]
"""A record's delivery report: called with ``(error, message)``, ``error`` ``None`` when it was delivered."""
Headers = dict[str, str | bytes | None] | list[tuple[str, str | bytes | None]]
"""Record headers: a dict, or a list of ``(name, value)`` pairs (names may repeat)."""

TWO_PC_CONFIG = "transaction.two.phase.commit.enable"
ANCHOR_TOPIC_CONFIG = "kafka2pc.anchor.topic"
DELIVERY_REPORTS_CONFIG = "kafka2pc.delivery.reports"
"""``"all"`` (default) or ``"errors"``: which delivery reports reach Python (see :class:`TwoPhaseCommitProducer`)."""
DEFAULT_ANCHOR_TOPIC = "kafka2pc-anchors"
"""Topic of the marker records that anchor offsets-only transactions (see :mod:`kafka2pc._state`)."""
ANCHOR_TOPIC_PARTITIONS = 8
"""Partitions of an anchor topic kafka2pc creates: markers of different ids spread over them.

A prepared transaction holds back its anchor partition's last stable offset,
which only delays the *outcome* probe of other ids' markers on that partition;
spreading the ids keeps that rare.
"""
_TOPIC_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,249}")
_REQUIRED_APIS = ("InitProducerId", "EndTxn", "DescribeTransactions", "DescribeProducers", "ListOffsets")
_timeout_warning_logged = False

DEFAULT_TIMEOUT_S = 60.0
"""The bound of ``init_transactions``, ``prepare_transaction``, ``commit_transaction``,
``abort_transaction`` and ``complete_transaction`` when the caller gives no ``timeout``.

The Java producer bounds the same calls by ``max.block.ms`` (60 s by default).
Without it librdkafka would wait until the broker returns, bounded only by
``transaction.timeout.ms`` (which kafka2pc raises to the broker's maximum, up
to about 35 minutes), holding the caller's database transaction all that time.
A call given ``timeout`` ends within it plus :data:`TIMEOUT_SLACK_S`.
"""
TIMEOUT_SLACK_S = 1.0
"""What a bounded call may overrun its ``timeout`` by: the request or poll in
flight when the deadline passes (librdkafka and kafka-python check their
deadlines between polls of at most a few hundred milliseconds)."""


def _deadline_after(timeout: float | None) -> float:
    if timeout is not None and timeout < 0:
        raise UsageError(f"timeout must not be negative, got {timeout}")
    return time.monotonic() + (DEFAULT_TIMEOUT_S if timeout is None else timeout)


def _left(deadline: float, op: str) -> float:
    """Seconds left before ``deadline``; :class:`BrokerUnavailableError` once it has passed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise BrokerUnavailableError(f"{op}: no answer from the cluster within the timeout")
    return remaining

LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS = 2_147_483
"""The largest ``transaction.timeout.ms`` librdkafka handles: 2**31 microseconds.

Above it librdkafka's request deadlines wrap around (a 32-bit microsecond
count): requests time out the moment they are queued ("Timed out 1
out-queue" storms) and transactions stall for seconds.  Measured with
librdkafka 2.16 against a broker whose ``transaction.max.timeout.ms`` is one
hour: 2,147,483 ms ran clean, 2,200,000 ms did not, 3,600,000 ms ran at less
than half the throughput.  kafka2pc caps the timeout it picks here and
refuses a larger one set explicitly.
"""


def _as_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise UsageError(f"{name} must be true or false, not {value!r}")


def _check_librdkafka_config(conf: Mapping[str, Any]) -> None:
    """Raise :class:`UsageError` naming the key if librdkafka refuses ``conf`` (unknown key, bad value,
    ``acks`` other than ``all``, ``enable.idempotence=false``...).

    librdkafka validates the whole configuration when a client is created; a
    throwaway producer without bootstrap servers (it connects to nothing,
    about 3 ms) lets the constructor report what would otherwise surface as a
    raw ``KafkaException`` at ``init_transactions``.
    """
    probe = {k: v for k, v in conf.items() if k not in ("bootstrap.servers", "metadata.broker.list")}
    probe["log_level"] = 0  # no "no bootstrap.servers configured" notice
    try:
        Producer(probe)
    except KafkaException as exc:
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        detail = err.str() if err is not None else str(exc)
        raise UsageError(f"invalid producer configuration: {detail}") from exc
    except (TypeError, ValueError) as exc:
        raise UsageError(f"invalid producer configuration: {exc}") from exc


class TwoPhaseCommitProducer:
    """A transactional Kafka producer that can take part in a two-phase commit.

    It wraps a ``confluent_kafka.Producer`` (same configuration dict, same
    ``produce`` signature) and adds KIP-939's participant API: ``prepare_transaction``
    returns a :class:`PreparedTxnState` to store in your database *in the same
    database transaction* as your data; ``complete_transaction(state)`` commits
    if ``state`` names the prepared transaction and aborts otherwise;
    ``init_transactions(keep_prepared_txn=True)`` lets a restarted process settle
    the prepared transaction of the one that crashed instead of aborting it.

    Example (normal path, then recovery in a new process)::

        p = TwoPhaseCommitProducer({"bootstrap.servers": "localhost:9092",
                                    "transactional.id": "orders-1"})
        p.init_transactions()
        p.begin_transaction()
        p.produce("orders", key=b"42", value=b"created")
        state = p.prepare_transaction()
        db.store(str(state)); db.commit()          # the decision point
        p.commit_transaction()

        # after a crash, in a new process:
        p = TwoPhaseCommitProducer(same_config)
        p.init_transactions(keep_prepared_txn=True)
        p.complete_transaction(PreparedTxnState(db.load()))

    Not thread-safe for concurrent transaction control; ``produce`` may be
    called from the thread that runs the transaction.

    ``kafka2pc.delivery.reports`` (a kafka2pc setting in the same dict):
    ``"all"`` (default) serves a delivery report per record, and the first
    successful one anchors the prepared state for free.  ``"errors"`` serves
    only failed deliveries (librdkafka's ``delivery.report.only.error``; a
    success report is about a tenth of the CPU of a record sent with
    :meth:`produce_batch`); ``prepare_transaction`` then asks the leaders of
    the partitions the transaction wrote for its first offset
    (DescribeProducers, one request per partition until one answers: partition
    0 first, then, after a metadata request, the others of a topic written
    without an explicit partition), which names the same transaction.  A
    failed delivery fails the prepare in both modes; ``on_delivery`` callbacks
    see only failures in ``"errors"`` mode.  Setting
    ``delivery.report.only.error`` directly is refused.

    ``on_delivery`` in the configuration is, as in confluent-kafka, the
    callback of every record sent without one of its own (:meth:`produce_batch`
    included); one passed to :meth:`produce` replaces it for that record.
    """

    def __init__(self, config: Mapping[str, Any], *, control_plane: ControlPlane | None = None) -> None:
        conf = dict(config)
        tid = conf.get("transactional.id")
        if not isinstance(tid, str) or not tid:
            raise UsageError("config must set 'transactional.id' to a non-empty string")
        self._transactional_id = tid
        self._two_pc_requested = _as_bool(conf.pop(TWO_PC_CONFIG, False), TWO_PC_CONFIG)
        anchor_topic = conf.pop(ANCHOR_TOPIC_CONFIG, DEFAULT_ANCHOR_TOPIC)
        if not isinstance(anchor_topic, str) or not _TOPIC_NAME_RE.fullmatch(anchor_topic) or anchor_topic in (
            ".", ".."
        ):
            raise UsageError(f"{ANCHOR_TOPIC_CONFIG} must be a valid topic name, not {anchor_topic!r}")
        self._anchor_topic = anchor_topic
        self._anchor_topic_checked = False
        reports = conf.pop(DELIVERY_REPORTS_CONFIG, "all")
        if reports not in ("all", "errors"):
            raise UsageError(f"{DELIVERY_REPORTS_CONFIG} must be 'all' or 'errors', not {reports!r}")
        if self._two_pc_requested and "transaction.timeout.ms" in conf:
            raise UsageError(
                f"{TWO_PC_CONFIG}=true and transaction.timeout.ms cannot be set together (KIP-939)"
            )
        if "transaction.timeout.ms" in conf:
            try:
                timeout_ms = int(conf["transaction.timeout.ms"])
            except (TypeError, ValueError):
                raise UsageError(
                    f"transaction.timeout.ms must be an integer number of milliseconds, "
                    f"not {conf['transaction.timeout.ms']!r}"
                ) from None
            if timeout_ms > LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS:
                raise UsageError(
                    f"transaction.timeout.ms={timeout_ms} is above {LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS} "
                    "(2**31 microseconds), where librdkafka's request timeouts wrap around and every "
                    "request times out at once; leave it unset to get the broker's maximum within that limit"
                )
        if "delivery.report.only.error" in conf and _as_bool(
            conf["delivery.report.only.error"], "delivery.report.only.error"
        ):
            # The anchor of a prepared state is the first *successful* delivery report:
            # without them every transaction would look empty, and completing its state
            # would abort it.
            raise UsageError(
                "delivery.report.only.error=true is not supported: kafka2pc names each prepared transaction "
                f"by the offset its first record was delivered at, which only a successful delivery report says "
                f"(set {DELIVERY_REPORTS_CONFIG}=errors instead)"
            )
        self._errors_only = reports == "errors"
        if self._errors_only:
            conf["delivery.report.only.error"] = True
        default_cb = conf.pop("on_delivery", None)
        if default_cb is not None and not callable(default_cb):
            raise UsageError(f"on_delivery must be a callable (err, msg), not {default_cb!r}")
        _check_librdkafka_config(conf)
        self._config = conf
        self._ctrl = control_plane or ControlPlane(conf)
        self._owns_ctrl = control_plane is None
        self._machine = StateMachine()
        self._producer: Producer | None = None
        self._producer_id = -1
        self._epoch = -1
        self._ids_stale = True
        self._anchor: tuple[str, int, int] | None = None
        self._written: dict[str, set[int] | None] = {}
        """With ``kafka2pc.delivery.reports=errors``: topic -> the partitions written (``None``: any)."""
        self._offsets_sent = False
        self._marker_queued = False
        self._plain_init = False
        self._delivery_error: KafkaError | None = None
        self._prepared: PreparedTxnState | None = None
        self._last_settlement: Settlement | None = None
        self._abort_doubtful = False
        """The last abort ran with records in flight: the coordinator may still hold it open."""
        # The producer-level delivery callback (librdkafka's default for records sent
        # without one; it calls the configuration's own ``on_delivery``): a record
        # without a callback of its own carries no per-record Python object.
        self._plain_delivery_callback = self._delivery_callback(default_cb)

    # -- introspection --------------------------------------------------------
    @property
    def transactional_id(self) -> str:
        """The ``transactional.id`` this producer owns."""
        return self._transactional_id

    @property
    def state(self) -> TxnState:
        """The producer's transaction state (see :class:`TxnState`)."""
        return self._machine.state

    @property
    def prepared_state(self) -> PreparedTxnState | None:
        """The state returned by the last ``prepare_transaction`` while it is prepared or in doubt."""
        return self._prepared

    @property
    def last_settlement(self) -> Settlement | None:
        """What the last recovery-path completion decided and observed."""
        return self._last_settlement

    @property
    def control_plane(self) -> ControlPlane:
        """The coordinator client this producer uses for recovery."""
        return self._ctrl

    # -- life cycle -------------------------------------------------------------
    def init_transactions(self, timeout: float | None = None, *, keep_prepared_txn: bool = False) -> None:
        """Register the transactional id with its coordinator.

        ``keep_prepared_txn=False`` (the default) aborts any transaction a
        previous instance left open and fences it.  ``keep_prepared_txn=True``
        leaves that transaction alone: the producer then only accepts
        ``commit_transaction``, ``abort_transaction`` or
        ``complete_transaction(state)``, which settle it through the
        coordinator and then fence the previous instance.

        Ends within ``timeout`` (default :data:`DEFAULT_TIMEOUT_S`) plus
        :data:`TIMEOUT_SLACK_S`; an unreachable cluster raises
        :class:`BrokerUnavailableError`.
        """
        self._machine.check("init_transactions")
        deadline = _deadline_after(timeout)
        with self._bounded(deadline, "init_transactions"):
            self._check_broker()
        if keep_prepared_txn:
            self._machine.transition_to(TxnState.RECOVERING)
            return
        self._start_producer(deadline)
        self._plain_init = True
        self._machine.transition_to(TxnState.READY)

    def begin_transaction(self) -> None:
        """Start a transaction (no broker round trip)."""
        self._machine.check("begin_transaction")
        self._plain_init = False
        self._anchor = None
        self._written = {}
        self._offsets_sent = False
        self._marker_queued = False
        self._delivery_error = None
        self._prepared = None
        self._call(lambda p: p.begin_transaction(), "begin_transaction")
        self._machine.transition_to(TxnState.IN_TRANSACTION)

    def produce(
        self,
        topic: str,
        value: str | bytes | None = None,
        key: str | bytes | None = None,
        partition: int = -1,
        on_delivery: DeliveryCallback | None = None,
        timestamp: int = 0,
        headers: Headers | None = None,
        *,
        callback: DeliveryCallback | None = None,
    ) -> None:
        """Send a record within the transaction: the parameters of ``confluent_kafka.Producer.produce``.

        ``partition=-1`` lets the configured partitioner choose; ``on_delivery``
        is called with ``(error, message)`` from :meth:`poll` or :meth:`flush`
        once the record is delivered or failed; ``timestamp`` is in
        milliseconds since the epoch (``0``: now), as Kafka stores it;
        ``headers`` is a dict or a list of ``(name, value)`` pairs.
        ``callback`` is confluent-kafka's other name for ``on_delivery``.

        Raises :class:`QueueFullError` (also a ``BufferError``) when the local queue is full.

        Example::

            producer.produce("orders", value=b"created", key=b"42", headers={"source": b"web"})
        """
        self._machine.check("produce")
        user_cb = on_delivery if on_delivery is not None else callback
        producer = self._require_producer()
        if self._errors_only:
            self._note_written(topic, partition)
        try:
            if user_cb is None and partition == -1 and timestamp == 0 and headers is None:
                producer.produce(topic, value, key)
            else:
                producer.produce(
                    topic, value=value, key=key, partition=partition,
                    on_delivery=None if user_cb is None else self._delivery_callback(user_cb),
                    timestamp=timestamp, headers=headers,
                )
        except BufferError as exc:
            raise QueueFullError(str(exc)) from exc
        except KafkaException as exc:
            raise self._failed("produce", exc) from exc

    def produce_batch(
        self,
        topic: str,
        values: Sequence[str | bytes | None],
        keys: Sequence[str | bytes | None] | None = None,
        *,
        partition: int | None = None,
        timeout: float | None = None,
    ) -> int:
        """Send ``len(values)`` records to ``topic`` within the transaction, in order; return how many.

        Record ``i`` has value ``values[i]`` and key ``keys[i]`` (no key when
        ``keys`` is ``None``); all go to ``partition``, or where the
        configured partitioner puts each key when it is ``None``.  Same
        outcome as calling :meth:`produce` for each record, for about 40 %
        less CPU per record: each record goes straight to librdkafka's
        produce call, without :meth:`produce`'s per-call checks and argument
        handling.  Delivery reports are served as for
        :meth:`produce` (by :meth:`poll`, :meth:`flush`,
        :meth:`prepare_transaction`): the first one delivered anchors the
        :class:`PreparedTxnState`, and a failed one fails the prepare.

        No headers, timestamps or per-record partitions or callbacks: use
        :meth:`produce` for those.  While librdkafka's local queue is full it
        serves delivery reports and retries the records not queued yet, in
        order, up to ``timeout`` seconds (default :data:`DEFAULT_TIMEOUT_S`);
        then it raises :class:`QueueFullError`, whose ``queued`` says how many
        records were queued (abort the transaction, or send the rest).  Any
        other error raises the translated kafka2pc error, as :meth:`produce`.
        """
        self._machine.check("produce")
        if keys is not None and len(keys) != len(values):
            raise UsageError(f"produce_batch: {len(values)} values but {len(keys)} keys")
        producer = self._require_producer()
        if self._errors_only and values:
            self._note_written(topic, partition)
        deadline = _deadline_after(timeout)
        # One librdkafka produce call per record, in the tightest loop Python
        # allows: cheaper than confluent-kafka's Producer.produce_batch, which
        # needs a dict per record.  Delivery reports go to the producer-level
        # callback (_producer_config).
        raw = producer.produce
        total = len(values)
        start = 0
        while start < total:
            i = start
            try:
                if partition is None:
                    if keys is None:
                        for i in range(start, total):
                            raw(topic, values[i])
                    else:
                        for i in range(start, total):
                            raw(topic, values[i], keys[i])
                elif keys is None:
                    for i in range(start, total):
                        raw(topic, values[i], None, partition)
                else:
                    for i in range(start, total):
                        raw(topic, values[i], keys[i], partition)
                break
            except BufferError:  # record i was not queued: serve reports until there is room
                if time.monotonic() >= deadline:
                    raise QueueFullError(
                        f"produce_batch({topic!r}): the local queue stayed full; {i} of {total} records "
                        "were queued", queued=i,
                    ) from None
                self._call(lambda p: p.poll(0.01), "produce_batch")
                start = i
            except KafkaException as exc:
                raise self._failed("produce_batch", exc) from exc
            except TypeError as exc:  # records before i were queued, as with produce() per record
                raise UsageError(f"produce_batch({topic!r}): record {i}: {exc}") from exc
        return total

    def _note_written(self, topic: str, partition: int | None) -> None:
        """Remember where the transaction wrote (``kafka2pc.delivery.reports=errors`` finds its anchor there)."""
        known = self._written.get(topic, set())
        if known is None:
            return
        if partition is None or partition < 0:
            self._written[topic] = None
        else:
            known.add(partition)
            self._written[topic] = known

    def poll(self, timeout: float = 0) -> int:
        """Serve delivery reports (as ``confluent_kafka.Producer.poll``).

        A fatal producer error (e.g. fenced by a newer instance) raises the
        translated kafka2pc error, never a raw ``KafkaException``.
        """
        return int(self._call(lambda p: p.poll(timeout), "poll"))

    def flush(self, timeout: float = -1) -> int:
        """Wait for outstanding records (as ``confluent_kafka.Producer.flush``); errors as :meth:`poll`."""
        return int(self._call(lambda p: p.flush(timeout), "flush"))

    def __len__(self) -> int:
        return len(self._producer) if self._producer is not None else 0

    def send_offsets_to_transaction(
        self, offsets: list[Any], group_metadata: Any, timeout: float | None = None
    ) -> None:
        """Add consumer offsets to the transaction (exactly-once consume-transform-produce).

        A transaction that writes no record besides these offsets is anchored
        on a tiny marker record that ``prepare_transaction`` writes to the
        anchor topic (``kafka2pc.anchor.topic``, default ``kafka2pc-anchors``,
        created on first use), so that its :class:`PreparedTxnState` names it
        exactly.  A transaction with records pays nothing extra.
        """
        self._machine.check("send_offsets_to_transaction")
        self._offsets_sent = True  # set first: a call that times out may still have reached the broker
        args = (offsets, group_metadata) if timeout is None else (offsets, group_metadata, timeout)
        self._call(lambda p: p.send_offsets_to_transaction(*args), "send_offsets_to_transaction")

    def prepare_transaction(self, timeout: float | None = None) -> PreparedTxnState:
        """Flush every record of the transaction and return its :class:`PreparedTxnState`.

        After this only ``commit_transaction``, ``abort_transaction`` and
        ``complete_transaction`` are allowed.  A record that failed delivery
        raises :class:`AbortableError` (abort and retry the transaction), or
        :class:`ProducerFencedError` when a newer instance (e.g. a recovery) has
        fenced this one; a flush that did not finish in ``timeout`` seconds
        (default :data:`DEFAULT_TIMEOUT_S`, e.g. while the broker is down)
        raises :class:`RetriableError` and leaves the transaction open (call
        again, or abort).

        The state names exactly this transaction whatever it holds: a
        transaction with records is anchored on its first delivered record (no
        extra round trip); one with only consumer offsets gets a marker record
        in the anchor topic first (one more produce, and once per producer a
        topic lookup, creating the topic if it is missing); one that sent
        nothing says so.
        """
        self._machine.check("prepare_transaction")
        deadline = _deadline_after(timeout)
        self._flush_for_prepare(max(deadline - time.monotonic(), 0.0))
        if self._anchor is None and self._offsets_sent and not self._marker_queued:
            self._queue_marker(deadline)
            self._flush_for_prepare(max(deadline - time.monotonic(), 0.0))
        if self._ids_stale:
            with self._bounded(deadline, "prepare_transaction"):
                self._refresh_ids()
        if self._anchor is None and self._written:
            self._anchor = self._find_anchor(deadline)
        anchor = self._anchor
        if anchor is None and self._offsets_sent:  # pragma: no cover - a delivered marker sets the anchor
            raise FatalError(f"prepare_transaction({self._transactional_id!r}): the marker record has no offset")
        state = PreparedTxnState._build(
            self._producer_id, self._epoch, self._transactional_id,
            None if anchor is None else TopicAndPartition(anchor[0], anchor[1]),
            -1 if anchor is None else anchor[2],
            sent_nothing=anchor is None,
        )
        self._prepared = state
        self._machine.transition_to(TxnState.PREPARED)
        logger.debug("%s: prepared %s", self._transactional_id, state)
        return state

    def _find_anchor(self, deadline: float) -> tuple[str, int, int]:
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
                offset = self._txn_start_offset(TopicAndPartition(topic, 0), deadline)
                if offset is not None:
                    return topic, 0, offset
                asked.add(0)
                left = _left(deadline, op)
                try:
                    metadata = self._require_producer().list_topics(topic, timeout=left)
                except KafkaException as exc:
                    raise self._failed(op, exc) from exc
                described = metadata.topics.get(topic)
                partitions = set(described.partitions) if described is not None else set()
            for partition in sorted(partitions - asked):
                offset = self._txn_start_offset(TopicAndPartition(topic, partition), deadline)
                if offset is not None:
                    return topic, partition, offset
        # Every record was delivered (no error report), yet no partition has the transaction open:
        # another instance fenced this one, or it was aborted meanwhile.
        error = AbortableError(
            f"{op}({self._transactional_id!r}): no partition the transaction wrote has it open any more "
            f"(producer {self._producer_id}, epoch {self._epoch}); it was aborted or fenced: abort and retry"
        )
        self._machine.transition_to(TxnState.ABORTABLE_ERROR, cause=error)
        raise error

    def _txn_start_offset(self, tp: TopicAndPartition, deadline: float) -> int | None:
        """This producer's open transaction's first offset on ``tp`` (DescribeProducers), if it has one there."""
        with self._bounded(deadline, "prepare_transaction"):
            producers = self._ctrl.describe_producers(tp)
        for p in producers:
            mine = p.producer_id == self._producer_id and p.producer_epoch == self._epoch
            if mine and p.current_txn_start_offset >= 0:
                return p.current_txn_start_offset
        return None

    def _flush_for_prepare(self, timeout: float) -> None:
        """Flush; raise the first delivery error (abortable or fatal), or RetriableError on timeout."""
        remaining = self._call(lambda p: p.flush(timeout), "prepare_transaction")
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
        producer = self._require_producer()
        if self._errors_only:
            self._note_written(self._anchor_topic, None)
        try:
            producer.produce(self._anchor_topic, key=self._transactional_id.encode(), value=b"")
        except BufferError as exc:
            raise QueueFullError(str(exc)) from exc
        except KafkaException as exc:
            raise self._failed("prepare_transaction", exc) from exc
        self._marker_queued = True

    def _ensure_anchor_topic(self, deadline: float) -> None:
        """Create the anchor topic if it is missing (once per producer); errors say what to do."""
        topic = self._anchor_topic
        with self._bounded(deadline, "prepare_transaction"):
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
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
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

    def commit_transaction(self, timeout: float | None = None) -> None:
        """Commit the current (prepared or not) transaction.

        After ``init_transactions(keep_prepared_txn=True)`` this commits
        whatever transaction the previous instance left open.  A timeout
        (default :data:`DEFAULT_TIMEOUT_S`) raises :class:`IndefiniteOutcomeError`:
        retry the call, or settle with ``complete_transaction(state)``; no new
        transaction starts before that.
        """
        source = self._machine.check("commit_transaction")
        if source is TxnState.RECOVERING or (source is TxnState.IN_DOUBT and self._producer is None):
            self._settle_open(commit=True, timeout=timeout)
            return
        self._end_local(commit=True, timeout=timeout)

    def abort_transaction(self, timeout: float | None = None) -> None:
        """Abort the current transaction (or, when recovering, the one left open).

        Records still in flight are delivered first (within half the
        ``timeout``), so that the abort cannot race their partitions'
        registration with the coordinator (librdkafka issue #4849): their
        delivery reports succeed, and the abort marker hides them from
        ``read_committed`` consumers.  If librdkafka's abort fails anyway
        (INVALID_TXN_STATE, fatal), what the coordinator holds open for this
        producer is aborted there before the error is raised.
        """
        source = self._machine.check("abort_transaction")
        if source is TxnState.RECOVERING or (source is TxnState.IN_DOUBT and self._producer is None):
            self._settle_open(commit=False, timeout=timeout)
            return
        self._end_local(commit=False, timeout=timeout)

    def complete_transaction(self, state: PreparedTxnState, timeout: float | None = None) -> None:
        """Commit if ``state`` names the prepared transaction, else abort it (KIP-939).

        Works after ``prepare_transaction`` in this process, after
        ``init_transactions(keep_prepared_txn=True)`` in a new one, and after an
        indefinite (timed-out) commit or abort.  Retry-safe: completing an
        already committed transaction with its own state succeeds.  If Kafka
        aborted the transaction ``state`` names (transaction timeout, operator),
        raises :class:`HeuristicOutcomeError` — never reports success.
        Afterwards the producer has a fresh epoch (older instances are fenced)
        and accepts new transactions.  Given a ``timeout``, ends within it plus
        :data:`TIMEOUT_SLACK_S` (an unreachable cluster raises
        :class:`BrokerUnavailableError` and leaves the transaction as it was).
        """
        if not isinstance(state, PreparedTxnState):
            raise UsageError(f"complete_transaction() takes a PreparedTxnState, not {type(state).__name__}")
        if self._plain_init and self._machine.state is TxnState.READY:
            raise IllegalStateError(
                f"complete_transaction({state}) after a plain init_transactions(): that call aborted any "
                f"transaction a previous instance of {self._transactional_id!r} had left open, prepared or not "
                "(KIP-939), so the transaction this state names was aborted if it was still open. To settle a "
                "stored state after a restart, call init_transactions(keep_prepared_txn=True) on a new producer, "
                "then complete_transaction(state)"
            )
        source = self._machine.check("complete_transaction")
        state.check_transactional_id(self._transactional_id)
        if source is TxnState.PREPARED:
            if state == self._prepared:
                self._end_local(commit=True, timeout=timeout)
            else:
                logger.info("%s: state %s is not the prepared %s: aborting", self._transactional_id,
                            state, self._prepared)
                self._end_local(commit=False, timeout=timeout)
            return
        # Given a ``timeout``, the settlement and the re-initialisation that follows share
        # it.  Without one, the settlement is bounded by the control plane's own timeouts
        # (the dual-write recipe's recover() relies on it waiting out a broker restart)
        # and the re-initialisation by DEFAULT_TIMEOUT_S.
        deadline = None if timeout is None else _deadline_after(timeout)
        try:
            if deadline is None:
                self._last_settlement = settle(self._ctrl, self._transactional_id, state)
            else:
                with self._bounded(deadline, "complete_transaction"):
                    self._last_settlement = settle(self._ctrl, self._transactional_id, state)
        except IndefiniteOutcomeError:
            if source is not TxnState.IN_DOUBT:
                self._machine.transition_to(TxnState.IN_DOUBT, operation="complete_transaction")
            raise
        except HeuristicOutcomeError:
            # A heuristic outcome is settled: fence and move on.
            self._reinitialize(_deadline_after(None) if deadline is None else deadline)
            raise
        # Any other error (broker unavailable, authorization...) leaves the transaction
        # as it was: re-initialising now would abort a prepared transaction whose
        # commit was decided.  The caller retries complete_transaction.
        self._reinitialize(_deadline_after(None) if deadline is None else deadline)

    def close(self, timeout: float = 30.0) -> None:
        """Flush nothing, release the producer and the control plane connections.

        After an abort that ran while records were still in flight, the
        coordinator is asked first (within ``timeout``) and a transaction it
        still holds open is aborted, so the transactional id is handed back
        with nothing open.
        """
        if self._abort_doubtful and self._producer is not None and self.state is TxnState.READY:
            self._end_left_open(_deadline_after(timeout))
        if self._producer is not None:
            try:
                self._producer.flush(0)
            except KafkaException as exc:  # e.g. fenced: nothing left to deliver anyway
                logger.debug("%s: close() ignored %s", self._transactional_id, exc)
            self._producer = None
        if self._owns_ctrl:
            self._ctrl.close()
        if self._machine.state is not TxnState.CLOSED:
            self._machine.transition_to(TxnState.CLOSED)

    def __enter__(self) -> TwoPhaseCommitProducer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------
    def _check_broker(self) -> None:
        versions = self._ctrl.api_versions()
        missing = [api for api in _REQUIRED_APIS if api not in versions]
        if missing:
            raise UnsupportedBrokerError(
                f"the broker does not support {', '.join(missing)}, which kafka2pc needs (Kafka >= 3.0)"
            )
        if self._two_pc_requested:
            # KIP-939 2PC needs the broker to offer it (InitProducerId v6 and the
            # broker setting) *and* the client to send Enable2Pc.  A broker that
            # refuses it is an error, as in KIP-939.  A broker that offers it is
            # accepted, but librdkafka cannot send Enable2Pc: transactions stay
            # bounded by transaction.timeout.ms (raised to the broker maximum, with
            # the warning logged in _producer_config).
            top = versions["InitProducerId"][1]
            enabled = self._ctrl.broker_config([TWO_PC_CONFIG]).get(TWO_PC_CONFIG)
            if top < 6 or enabled != "true":
                raise UnsupportedBrokerError(
                    f"{TWO_PC_CONFIG}=true was asked, but the broker does not offer 2PC to clients: it "
                    f"advertises InitProducerId up to v{top} (KIP-939 needs v6) and has "
                    f"{TWO_PC_CONFIG}={enabled or 'absent'}. Drop the setting: prepared transactions are "
                    "then bounded by the broker's transaction.max.timeout.ms, and one the broker aborts on "
                    "timeout is reported by recovery as HeuristicOutcomeError",
                    error_name="UNSUPPORTED_VERSION",
                )

    def _producer_config(self) -> dict[str, Any]:
        global _timeout_warning_logged
        conf = dict(self._config)
        if "transaction.timeout.ms" not in conf:
            limit = self._ctrl.broker_config(["transaction.max.timeout.ms"]).get("transaction.max.timeout.ms")
            chosen = min(int(limit), LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS) if limit else None
            if chosen is not None:
                conf["transaction.timeout.ms"] = chosen
            if not _timeout_warning_logged:
                _timeout_warning_logged = True
                logger.info(
                    "librdkafka cannot open 2PC transactions (no Enable2Pc): prepared transactions are "
                    "aborted by the broker after transaction.timeout.ms=%s ms (the broker's "
                    "transaction.max.timeout.ms=%s%s); recovery reports such aborts as heuristic outcomes",
                    chosen, limit,
                    f", capped at librdkafka's limit of {LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS} ms"
                    if chosen == LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS else "",
                )
        conf["on_delivery"] = self._plain_delivery_callback
        return with_librdkafka_logger(conf)  # librdkafka's logs -> logging (kafka2pc._logging)

    @contextmanager
    def _bounded(self, deadline: float, op: str) -> Iterator[None]:
        """Hold the control-plane calls made in the block to ``deadline``."""
        with self._ctrl.deadline(_left(deadline, op)):
            yield

    def _start_producer(self, deadline: float) -> None:
        op = f"init_transactions({self._transactional_id!r})"
        with self._bounded(deadline, op):
            config = self._producer_config()
        producer = Producer(config)
        try:
            producer.init_transactions(_left(deadline, op))
        except KafkaException as exc:
            raise translate_confluent_error(exc, op) from exc
        self._producer = producer
        with self._bounded(deadline, op):
            self._refresh_ids()

    def _refresh_ids(self) -> None:
        desc = self._ctrl.describe_transaction(self._transactional_id)
        if desc is None:
            raise FatalError(f"the coordinator does not know {self._transactional_id!r} after init")
        self._producer_id, self._epoch = desc.producer_id, desc.producer_epoch
        self._ids_stale = False

    def _reinitialize(self, deadline: float) -> None:
        """Replace the librdkafka producer: a new InitProducerId bumps the epoch and fences older ones."""
        old, self._producer = self._producer, None
        if old is not None:
            old.purge()
            del old
        self._start_producer(deadline)
        self._prepared = None
        self._machine.transition_to(TxnState.READY)

    def _settle_open(self, *, commit: bool, timeout: float | None) -> None:
        desc = self._ctrl.describe_transaction(self._transactional_id)
        if desc is not None and desc.state == "Ongoing":
            self._ctrl.end_txn(self._transactional_id, desc.producer_id, desc.producer_epoch, commit=commit)
            logger.info("%s: %s the transaction left open by producer %d/%d", self._transactional_id,
                        "committed" if commit else "aborted", desc.producer_id, desc.producer_epoch)
        self._reinitialize(_deadline_after(timeout))

    def _end_local(self, *, commit: bool, timeout: float | None) -> None:
        op = "commit_transaction" if commit else "abort_transaction"
        producer = self._require_producer()
        deadline = _deadline_after(timeout)
        registered = True
        if not commit:
            registered = self._settle_registrations(producer, deadline)
        args = (max(0.001, deadline - time.monotonic()),)
        try:
            producer.commit_transaction(*args) if commit else producer.abort_transaction(*args)
        except KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            if not commit and err is not None and err.code() == KafkaError.INVALID_TXN_STATE:
                # The abort lost librdkafka's race: the producer is unusable, the coordinator may hold
                # the transaction open.  End it there, then report the producer's fatal error.
                logger.info("%s: librdkafka's abort failed (%s): ending the transaction at the coordinator",
                            self._transactional_id, err.name())
                self._end_left_open(deadline)
            if err is not None and err.retriable() and not err.fatal() and not err.txn_requires_abort():
                indefinite = IndefiniteOutcomeError(
                    f"{op}() of {self._prepared or 'the transaction'} timed out: outcome unknown; retry it "
                    "or call complete_transaction(state)",
                    state=self._prepared, error_name=err.name(), error_code=err.code(),
                )
                self._machine.transition_to(TxnState.IN_DOUBT, cause=indefinite, operation=op)
                raise indefinite from exc
            raise self._failed(op, exc) from exc
        if not commit:
            self._ids_stale = True  # librdkafka may bump the epoch while aborting
            self._abort_doubtful = not registered
        self._prepared = None
        self._machine.transition_to(TxnState.READY)

    def _settle_registrations(self, producer: Producer, deadline: float) -> bool:
        """Deliver what the transaction produced before aborting it; True if nothing is left in flight.

        librdkafka's abort races a partition registration (AddPartitionsToTxn)
        still in flight (librdkafka issue #4849): the abort fails fatally with
        INVALID_TXN_STATE, or the coordinator keeps the transaction open after
        the producer is gone.  A record delivered is a partition registered,
        so a flush settles the race; it gets half the abort's time.
        """
        try:
            return int(producer.flush(max(0.0, (deadline - time.monotonic()) / 2))) == 0
        except (KafkaException, SystemError):  # a fenced or fatal producer: the abort reports it
            return False

    def _end_left_open(self, deadline: float) -> None:
        """End what the coordinator still holds open for this producer after its abort (by ``deadline``).

        The coordinator may keep the transaction ``Ongoing`` after librdkafka's
        abort (librdkafka issue #4849).  DescribeTransactions says; if it is
        this producer's (same producer id and epoch: never another instance's),
        EndTxn(abort) ends it.  A failure is logged, not raised: the caller's
        own outcome stands, and the coordinator aborts the transaction at its
        timeout at the latest.
        """
        self._abort_doubtful = False
        try:
            with self._bounded(deadline, f"checking the coordinator after aborting {self._transactional_id!r}"):
                desc = self._ctrl.describe_transaction(self._transactional_id)
                if desc is None or desc.state != "Ongoing":
                    return
                if (desc.producer_id, desc.producer_epoch) != (self._producer_id, self._epoch):
                    logger.warning("%s: the coordinator holds a transaction of producer %d/%d open, not this "
                                   "producer's (%d/%d): left alone", self._transactional_id, desc.producer_id,
                                   desc.producer_epoch, self._producer_id, self._epoch)
                    return
                self._ctrl.end_txn(self._transactional_id, desc.producer_id, desc.producer_epoch, commit=False)
        except Kafka2pcError as exc:
            logger.warning("%s: could not check the coordinator after an abort (%s): a transaction left open "
                           "ends at its timeout", self._transactional_id, exc)
            return
        logger.warning("%s: the coordinator still held the aborted transaction open (producer %d/%d): ended it",
                       self._transactional_id, desc.producer_id, desc.producer_epoch)

    def _failed(self, op: str, exc: KafkaException) -> Kafka2pcError:
        error = translate_confluent_error(exc, f"{op}({self._transactional_id!r})")
        if isinstance(error, FatalError):
            if self.state is not TxnState.FATAL_ERROR:  # poll()/flush() may report it again
                self._machine.transition_to(TxnState.FATAL_ERROR, cause=error)
        elif isinstance(error, AbortableError) and self.state in (TxnState.IN_TRANSACTION, TxnState.PREPARED):
            self._machine.transition_to(TxnState.ABORTABLE_ERROR, cause=error)
        return error

    def _call(self, fn: Callable[[Producer], Any], op: str) -> Any:
        try:
            return fn(self._require_producer())
        except KafkaException as exc:
            raise self._failed(op, exc) from exc
        except SystemError as exc:
            # confluent-kafka 2.16 (measured): a flush() that meets a fatal error (fenced)
            # sets its KafkaException, then runs delivery callbacks (purged records) with
            # the exception still set.  The interpreter raises SystemError, chained to the
            # KafkaException or (CPython 3.10, in a callback frame) having lost it.
            cause = _kafka_exception_in(exc) or self._fatal_error_probe()
            if cause is None:
                raise
            raise self._failed(op, cause) from exc

    def _fatal_error_probe(self) -> KafkaException | None:
        """librdkafka's fatal transaction error, if it is in its fatal state (no side effect).

        Only inside a transaction, where ``begin_transaction()`` cannot succeed: it
        fails with the fatal error in librdkafka's fatal state, with a state error otherwise.
        """
        if self.state not in (TxnState.IN_TRANSACTION, TxnState.PREPARED, TxnState.ABORTABLE_ERROR):
            return None
        try:
            self._require_producer().begin_transaction()
        except KafkaException as exc:
            return exc if exc.args and exc.args[0].fatal() else None
        return None

    def _require_producer(self) -> Producer:
        if self._producer is None:
            raise IllegalStateError(f"no producer in state {self.state.value}: call init_transactions() first")
        return self._producer

    def _delivery_callback(self, user_cb: Callable[..., Any] | None) -> Callable[[KafkaError | None, Message], None]:
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


def _kafka_exception_in(exc: BaseException) -> KafkaException | None:
    """The first KafkaException in ``exc``'s chain of causes and contexts."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, KafkaException):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


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

