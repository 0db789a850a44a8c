"""``TwoPhaseCommitProducer``: KIP-939's participant API over a confluent-kafka producer.

The public class, its transaction life cycle and its record path live here.
It holds collaborators, each an object that owns its state behind a small
interface (none reads another's fields):

* :class:`~kafka2pc._machine.StateMachine` -- the transaction state, one gate;
* :class:`~kafka2pc._calls.LibrdkafkaCalls` -- the librdkafka producer and the
  one way to call it (failures translated once);
* :class:`~kafka2pc._anchoring.Anchoring` -- the anchor that makes every
  prepared state name exactly one transaction;
* :class:`~kafka2pc._ending.Ending` -- the producer id and epoch, ending
  transactions and re-initialising (the abort race in :mod:`kafka2pc._abort_race`);
* :class:`~kafka2pc._control.ControlPlane` -- the coordinator client;
* :class:`~kafka2pc._fork.ForkGuard` -- the process that made the producer.

The producer itself owns what its callers see: the prepared state, the last
settlement, and whether the last ``init_transactions`` was a plain one.  The
configuration is :mod:`kafka2pc._producer_config`; the calls' bounds
:mod:`kafka2pc._deadline`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message

from kafka2pc._anchoring import Anchoring
from kafka2pc._calls import LibrdkafkaCalls, bounded
from kafka2pc._control import ControlPlane
from kafka2pc._deadline import DEFAULT_CLOSE_TIMEOUT_S, DEFAULT_TIMEOUT_S, deadline_after
from kafka2pc._deprecation import renamed
from kafka2pc._ending import Ending
from kafka2pc._exceptions import (
    HeuristicOutcomeError,
    IllegalStateError,
    IndefiniteOutcomeError,
    QueueFullError,
    UsageError,
)
from kafka2pc._fork import ForkGuard, abandon
from kafka2pc._machine import StateMachine, TxnState
from kafka2pc._producer_config import check_broker, parse_config
from kafka2pc._recovery import Settlement, settle
from kafka2pc._recovery_policy import LSO_WAIT_S
from kafka2pc._state import PreparedTxnState
from kafka2pc._types import TopicAndPartition

__all__ = ["DeliveryCallback", "Headers", "TwoPhaseCommitProducer"]

logger = logging.getLogger(__name__)

DeliveryCallback = Callable[[KafkaError | None, Message], None]
"""A record's delivery report: called with ``(error, message)``, ``error`` ``None`` when it was delivered."""
Headers = dict[str, str | bytes | None] | list[tuple[str, str | bytes | None]]
"""Record headers: a dict, or a list of ``(name, value)`` pairs (names may repeat)."""


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

    Not fork-safe, by design: used in a child process forked after it was
    made, every method raises :class:`ForkedProcessError` at once, before
    anything is sent (a new instance in the child would fence the parent's,
    so it cannot be remade behind your back).  Make the producer after the
    fork (gunicorn's ``post_worker_init``, Celery's ``worker_process_init``);
    :meth:`close` in the child returns at once and leaves the parent's
    producer alone.

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
        settings = parse_config(config)
        self._fork_guard = ForkGuard(f"TwoPhaseCommitProducer({settings.transactional_id!r})")
        self._transactional_id = settings.transactional_id
        self._two_pc_requested = settings.two_pc_requested
        self._errors_only = settings.errors_only
        """``kafka2pc.delivery.reports=errors``: ``produce`` tells the anchoring where the transaction wrote."""
        self._ctrl = control_plane or ControlPlane(settings.librdkafka)
        self._owns_ctrl = control_plane is None
        self._machine = StateMachine()
        self._calls = LibrdkafkaCalls(self._transactional_id, self._machine)
        self._anchoring = Anchoring(
            transactional_id=self._transactional_id, machine=self._machine, calls=self._calls, ctrl=self._ctrl,
            librdkafka=settings.librdkafka, errors_only=settings.errors_only, anchor_topic=settings.anchor_topic,
        )
        # The producer-level delivery callback (librdkafka's default for records sent without
        # one; it calls the configuration's own ``on_delivery``): a record without a callback
        # of its own carries no per-record Python object.
        self._ending = Ending(
            transactional_id=self._transactional_id, machine=self._machine, calls=self._calls, ctrl=self._ctrl,
            librdkafka=settings.librdkafka,
            delivery_callback=self._anchoring.delivery_callback(settings.default_callback),
        )
        self._plain_init = False
        """The last ``init_transactions`` was a plain one (it aborted what a previous instance left open)."""
        self._prepared: PreparedTxnState | None = None
        self._last_settlement: Settlement | None = None

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
        :class:`BrokerUnavailableError`; a retriable answer (a coordinator
        still loading) is asked again until then.
        """
        self._fork_guard.check()
        self._machine.check("init_transactions")
        deadline = deadline_after(timeout)
        with bounded(self._ctrl, deadline, "init_transactions"):
            check_broker(self._ctrl, two_pc_requested=self._two_pc_requested)
        if keep_prepared_txn:
            self._machine.transition_to(TxnState.RECOVERING)
            return
        self._ending.start_producer(deadline)
        self._plain_init = True
        self._machine.transition_to(TxnState.READY)

    def begin_transaction(self) -> None:
        """Start a transaction (no broker round trip)."""
        self._fork_guard.check()
        self._machine.check("begin_transaction")
        self._plain_init = False
        self._anchoring.reset()
        self._prepared = None
        self._calls.call(lambda p: p.begin_transaction(), "begin_transaction")
        self._machine.transition_to(TxnState.IN_TRANSACTION)

    def produce(
        self,
        topic: str,
        value: str | bytes | None = None,
        key: str | bytes | None = None,
        partition: int | None = None,
        on_delivery: DeliveryCallback | None = None,
        timestamp: int | None = None,
        headers: Headers | None = None,
        *,
        callback: DeliveryCallback | None = None,
    ) -> None:
        """Send a record within the transaction.

        The one ``produce`` parameter list of kafka2pc (this producer, the
        asyncio one, and a dual-write transaction's ``tx.produce``), in
        ``confluent_kafka.Producer.produce``'s order: ``partition`` (``None``:
        the configured partitioner chooses); ``on_delivery``, called with
        ``(error, message)`` from :meth:`poll` or :meth:`flush` once the
        record is delivered or failed; ``timestamp`` in milliseconds since the
        epoch, as Kafka stores it (``None``: now); ``headers``, a dict or a
        list of ``(name, value)`` pairs.  ``callback`` (confluent-kafka's
        other name for ``on_delivery``), ``partition=-1`` and ``timestamp=0``
        are deprecated spellings.

        Raises :class:`QueueFullError` (also a ``BufferError``) when the local queue is full.

        Example::

            producer.produce("orders", value=b"created", key=b"42", headers={"source": b"web"})
        """
        if callback is not None:
            renamed("TwoPhaseCommitProducer.produce(callback=...)", "on_delivery=")
            if on_delivery is None:
                on_delivery = callback
        if self._fork_guard.forked:  # one attribute read on the per-record path
            raise self._fork_guard.error()
        self._machine.check("produce")
        producer = self._calls.require()
        if partition == -1 or timestamp == 0:
            renamed("produce(partition=-1, timestamp=0)", "partition=None, timestamp=None (the defaults)")
            partition = None if partition == -1 else partition
            timestamp = None if timestamp == 0 else timestamp
        if self._errors_only:
            self._anchoring.note_written(topic, partition)
        try:
            if on_delivery is None and partition is None and timestamp is None and headers is None:
                producer.produce(topic, value, key)
            else:
                producer.produce(
                    topic, value=value, key=key, partition=-1 if partition is None else partition,
                    on_delivery=None if on_delivery is None else self._anchoring.delivery_callback(on_delivery),
                    timestamp=0 if timestamp is None else timestamp, headers=headers,
                )
        except BufferError as exc:
            raise QueueFullError(str(exc)) from exc
        except KafkaException as exc:
            raise self._calls.failed("produce", exc) from exc

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
        self._fork_guard.check()
        self._machine.check("produce")
        if keys is not None and len(keys) != len(values):
            raise UsageError(f"produce_batch: {len(values)} values but {len(keys)} keys")
        producer = self._calls.require()
        if self._errors_only and values:
            self._anchoring.note_written(topic, partition)
        deadline = deadline_after(timeout)
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
                self._calls.call(lambda p: p.poll(0.01), "produce_batch")
                start = i
            except KafkaException as exc:
                raise self._calls.failed("produce_batch", exc) from exc
            except TypeError as exc:  # records before i were queued, as with produce() per record
                raise UsageError(f"produce_batch({topic!r}): record {i}: {exc}") from exc
        return total

    def poll(self, timeout: float = 0) -> int:
        """Serve delivery reports (as ``confluent_kafka.Producer.poll``).

        A fatal producer error (e.g. fenced by a newer instance) raises the
        translated kafka2pc error, never a raw ``KafkaException``.
        """
        self._fork_guard.check()
        return int(self._calls.call(lambda p: p.poll(timeout), "poll"))

    def flush(self, timeout: float | None = None) -> int:
        """Wait for outstanding records, up to ``timeout`` seconds; return how many are still outstanding.

        ``None``: :data:`~kafka2pc.DEFAULT_TIMEOUT_S`.  A negative ``timeout``
        (confluent-kafka's "no bound") is deprecated: it still waits without
        a bound, and warns.  Errors as :meth:`poll`.
        """
        self._fork_guard.check()
        if timeout is not None and timeout < 0:
            renamed("flush(timeout=-1)", "flush(timeout=<seconds>) (None: DEFAULT_TIMEOUT_S)")
        bound = DEFAULT_TIMEOUT_S if timeout is None else -1 if timeout < 0 else timeout
        return int(self._calls.call(lambda p: p.flush(bound), "flush"))

    def __len__(self) -> int:
        return self._calls.outstanding()

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
        self._fork_guard.check()
        self._machine.check("send_offsets_to_transaction")
        self._anchoring.note_offsets_sent()  # first: a call that times out may still have reached the broker
        args = (offsets, group_metadata) if timeout is None else (offsets, group_metadata, timeout)
        self._calls.call(lambda p: p.send_offsets_to_transaction(*args), "send_offsets_to_transaction")

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
        self._fork_guard.check()
        self._machine.check("prepare_transaction")
        deadline = deadline_after(timeout)
        self._anchoring.flush_for_prepare(deadline)
        self._ending.refresh_stale_ids(deadline)
        producer_id, epoch = self._ending.ids
        anchor = self._anchoring.anchor(deadline, producer_id, epoch)
        state = PreparedTxnState._build(
            producer_id, epoch, self._transactional_id,
            None if anchor is None else TopicAndPartition(anchor[0], anchor[1]),
            -1 if anchor is None else anchor[2],
            sent_nothing=anchor is None,
        )
        self._prepared = state
        self._machine.transition_to(TxnState.PREPARED)
        logger.debug("%s: prepared %s", self._transactional_id, state)
        return state

    def commit_transaction(self, timeout: float | None = None) -> None:
        """Commit the current (prepared or not) transaction.

        After ``init_transactions(keep_prepared_txn=True)`` this commits
        whatever transaction the previous instance left open.  A timeout
        (default :data:`DEFAULT_TIMEOUT_S`) raises :class:`IndefiniteOutcomeError`:
        retry the call, or settle with ``complete_transaction(state)``; no new
        transaction starts before that.
        """
        self._fork_guard.check()
        source = self._machine.check("commit_transaction")
        if source is TxnState.RECOVERING or (source is TxnState.IN_DOUBT and self._calls.current is None):
            self._ending.settle_open(commit=True, timeout=timeout)
        else:
            self._ending.end_local(commit=True, timeout=timeout, prepared=self._prepared)
        self._prepared = None

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
        self._fork_guard.check()
        source = self._machine.check("abort_transaction")
        if source is TxnState.RECOVERING or (source is TxnState.IN_DOUBT and self._calls.current is None):
            self._ending.settle_open(commit=False, timeout=timeout)
        else:
            self._ending.end_local(commit=False, timeout=timeout, prepared=self._prepared)
        self._prepared = None

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
        self._fork_guard.check()
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
            commit = state == self._prepared
            if not commit:
                logger.info("%s: state %s is not the prepared %s: aborting", self._transactional_id,
                            state, self._prepared)
            self._ending.end_local(commit=commit, timeout=timeout, prepared=self._prepared)
            self._prepared = None
            return
        # Given a ``timeout``, the settlement and the re-initialisation that follows share
        # it.  Without one, the settlement is bounded by the control plane's own timeouts
        # (the dual-write recipe's recover() relies on it waiting out a broker restart)
        # and the re-initialisation by DEFAULT_TIMEOUT_S.
        deadline = None if timeout is None else deadline_after(timeout)
        try:
            if deadline is None:
                self._last_settlement = settle(self._ctrl, self._transactional_id, state)
            else:
                # A decided transaction whose marker never reaches its partition (a broker bug) is
                # waited for a third of the time left at most: the settlement then reports it
                # unknown in time, instead of the call running out of time on every retry.
                lso_wait_s = min(LSO_WAIT_S, max(0.0, (deadline - time.monotonic()) / 3))
                with bounded(self._ctrl, deadline, "complete_transaction"):
                    self._last_settlement = settle(self._ctrl, self._transactional_id, state, lso_wait_s=lso_wait_s)
        except IndefiniteOutcomeError:
            if source is not TxnState.IN_DOUBT:
                self._machine.transition_to(TxnState.IN_DOUBT, operation="complete_transaction")
            raise
        except HeuristicOutcomeError:
            # A heuristic outcome is settled: fence and move on.
            self._reinitialize(deadline)
            raise
        # Any other error (broker unavailable, authorization...) leaves the transaction
        # as it was: re-initialising now would abort a prepared transaction whose
        # commit was decided.  The caller retries complete_transaction.
        self._reinitialize(deadline)

    def _reinitialize(self, deadline: float | None) -> None:
        """A fresh epoch after a settlement (``deadline`` ``None``: :data:`DEFAULT_TIMEOUT_S` from now)."""
        self._ending.reinitialize(deadline_after(None) if deadline is None else deadline)
        self._prepared = None

    def close(self, timeout: float | None = None) -> None:
        """Flush nothing, release the producer and the control plane connections.

        After an abort that ran while records were still in flight, the
        coordinator is asked first (within ``timeout`` seconds; ``None``:
        :data:`~kafka2pc.DEFAULT_CLOSE_TIMEOUT_S`, 30 s) and a transaction it
        still holds open is aborted, so the transactional id is handed back
        with nothing open.

        In a child forked after the producer was made, ``close()`` returns at
        once and sends nothing: it marks this copy closed and leaves the
        inherited librdkafka producer and connections untouched (never
        flushed, closed or destroyed: their threads live in the parent, which
        keeps using them); they go away when the child exits.
        """
        if self._fork_guard.forked:
            abandon(self._calls.release(), self._ctrl if self._owns_ctrl else None)
            if self._machine.state is not TxnState.CLOSED:
                self._machine.transition_to(TxnState.CLOSED)
            return
        if timeout is None:
            timeout = DEFAULT_CLOSE_TIMEOUT_S
        self._ending.end_doubtful_abort(deadline_after(timeout))
        producer = self._calls.release()
        if producer is not None:
            try:
                producer.flush(0)
            except KafkaException as exc:  # e.g. fenced: nothing left to deliver anyway
                logger.debug("%s: close() ignored %s", self._transactional_id, exc)
        if self._owns_ctrl:
            self._ctrl.close()
        if self._machine.state is not TxnState.CLOSED:
            self._machine.transition_to(TxnState.CLOSED)

    def __enter__(self) -> TwoPhaseCommitProducer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
