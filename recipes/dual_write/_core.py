"""What a writer's normal path, its settlement and its recovery share (:class:`WriterCore`), and small helpers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa

from kafka2pc import (
    FatalError,
    InvalidPreparedStateError,
    Kafka2pcError,
    PreparedTxnState,
    ProducerFencedError,
    QueueFullError,
)

from ._events import Listeners
from ._lifecycle import WriterState, check_transition
from ._options import WriterOptions
from ._store import StateStore, store_for
from ._topics import DEFAULT_TOPIC_CHECK_TIMEOUT_S, TopicCheck
from ._values import Step, _encode_headers, _Record

if TYPE_CHECKING:
    from kafka2pc import TwoPhaseCommitProducer

    from ._runtime import Runtime

__all__ = ["WriterCore", "parse_stored_state"]

logger = logging.getLogger("kafka2pc.recipes.dual_write._writer")

_T = TypeVar("_T")


def parse_stored_state(tid: str, table: sa.Table, stored: str | None, *, then: str = "") -> PreparedTxnState:
    """The :class:`PreparedTxnState` of ``tid``'s state row (``None`` or empty: nothing prepared).

    A malformed value raises :class:`InvalidPreparedStateError` naming the row
    and saying it is an operator's decision (``then``: what to do next).
    """
    try:
        return PreparedTxnState(stored) if stored else PreparedTxnState()
    except InvalidPreparedStateError as exc:
        raise InvalidPreparedStateError(
            f"{tid!r}: the state row in {table.name} holds a malformed prepared state "
            f"{stored!r} ({exc}); fix or clear it (an operator decision){then}"
        ) from exc


class WriterCore:
    """What one writer's normal path, settlement and recovery share: its id, tables, options, producer and
    the state row as this writer last committed it, with the helpers every path uses.

    :class:`DualWriter` holds one and hands it to its :class:`Recovery` and
    :class:`Settler`; the state here changes only through the writer and those two.
    """

    def __init__(
        self, engine: sa.Engine, config: dict[str, Any], tid: str, options: WriterOptions, runtime: Runtime,
        table: sa.Table, outbox: sa.Table | None, listeners: Listeners,
    ) -> None:
        self.engine = engine
        self.config = config
        self.tid = tid
        self.table = table
        self.outbox = outbox
        self.retain = options.retain_records
        self.lock_timeout_s = options.lock_timeout_s
        self.settle_attempts = options.settle_attempts
        self.queue_full_timeout_s = options.queue_full_timeout_s
        self.kafka_timeout_s = options.kafka_timeout_s
        self.runtime = runtime
        self.listeners = listeners
        """The writer's step listeners (``on_step`` among them; a pool's writers share their pool's)."""
        self.store: StateStore = store_for(engine.dialect, table)
        self.status = WriterState.NEW
        self.producer: TwoPhaseCommitProducer | None = None
        self.last_state: str | None = None
        """The stored state as this writer (or its recovery) last committed it.  Valid while READY."""
        self.token: str | None = None
        """The state row's version as this writer (or its recovery) last committed it (see ``_store``)."""
        self.outbox_dirty = True
        """The outbox may hold rows of this id (deleted by the next transaction)."""
        self.in_doubt: PreparedTxnState | None = None
        self.in_doubt_since: float | None = None
        self.heuristics = 0
        # A new topic's metadata lookup is one of the transaction's Kafka calls: bounded by kafka_timeout_s too.
        self.topics = TopicCheck(config, blocking=runtime.blocking, timeout_s=self.kafka_timeout_s
                                 if self.kafka_timeout_s is not None else DEFAULT_TOPIC_CHECK_TIMEOUT_S)

    # -- the only places this state changes ------------------------------------------
    def take_producer(self) -> TwoPhaseCommitProducer | None:
        """The producer, which this writer no longer holds (to close or replace it)."""
        producer, self.producer = self.producer, None
        return producer

    def install(self, producer: TwoPhaseCommitProducer) -> None:
        """Hold ``producer`` (a recovery made it and settled the id with it)."""
        self.producer = producer

    def wrote(self, stored: str | None, token: str | None) -> None:
        """The state row now holds ``stored`` under version ``token`` (``None``: not known, recover first)."""
        self.last_state, self.token = stored, token

    def mark_outbox(self, dirty: bool) -> None:
        """Whether the outbox may hold rows of this id (the next transaction deletes them)."""
        self.outbox_dirty = dirty

    def doubt(self, state: PreparedTxnState) -> None:
        """``state`` is committed in the database and not known committed in Kafka."""
        self.in_doubt, self.in_doubt_since = state, time.monotonic()

    def settled(self) -> None:
        """Nothing is in doubt any more."""
        self.in_doubt = self.in_doubt_since = None

    def count_heuristic(self) -> None:
        self.heuristics += 1

    def abandon(self) -> None:
        """Closed without the gate: a forked child's copy of a writer, whose state is the parent's."""
        self.status = WriterState.CLOSED

    def to(self, target: WriterState) -> None:
        check_transition(self.tid, self.status, target)
        self.status = target

    def step(self, step: Step) -> None:
        """Tell the writer's listeners that ``step`` is reached."""
        self.listeners.fire_step(step)

    def kafka(self, call: Callable[[], _T]) -> _T:
        """A producer call; an error that is not a kafka2pc one (librdkafka's binding can raise a bare
        ``SystemError`` from ``flush`` on a fenced producer) becomes :class:`~kafka2pc.FatalError`."""
        try:
            return call()
        except Kafka2pcError:
            raise
        except Exception as exc:
            raise FatalError(f"{self.tid!r}: the producer failed: {exc!r}") from exc

    def new_producer(self) -> TwoPhaseCommitProducer:
        """A new producer for this writer's transactional id (each recovery makes one)."""
        return self.runtime.new_producer(self.config)

    def produce(self, producer: TwoPhaseCommitProducer, topic: str, kwargs: dict[str, Any]) -> None:
        """Produce one record; a full local queue is waited out for up to ``queue_full_timeout_s``."""
        if topic not in self.topics.known:
            self.topics.require(topic, self.tid)
        deadline: float | None = None
        while True:
            try:
                producer.produce(topic, **kwargs)
                return
            except QueueFullError:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.queue_full_timeout_s
                elif now > deadline:
                    raise
                producer.poll(0.05)
            except Kafka2pcError:
                raise
            except Exception as exc:  # as _kafka(): a bare error of the binding is fatal
                raise FatalError(f"{self.tid!r}: the producer failed: {exc!r}") from exc

    def parse(self, stored: str | None) -> PreparedTxnState:
        return parse_stored_state(self.tid, self.table, stored, then=", then recover()")

    def fenced_error(self, detail: str) -> ProducerFencedError:
        if self.status is not WriterState.FENCED:
            self.to(WriterState.FENCED)
        return ProducerFencedError(
            f"{self.tid!r}: {detail}: another instance (or an operator's `kafka2pc recover`) took over the "
            "transactional id; this transaction is rolled back on both sides and this writer stops "
            "(recover() takes over again)"
        )

    def taken_over_now(self) -> bool:
        """True when the state row no longer carries this writer's token (read in a new connection)."""
        token = self.token
        if token is None:
            return False
        try:
            with self.engine.connect() as conn:
                return self.store.version(conn, self.tid) != token
        except sa.exc.SQLAlchemyError:
            logger.debug("%s: cannot read the state row's version", self.tid, exc_info=True)
            return False

    def insert_outbox(self, conn: sa.Connection, state: PreparedTxnState, records: list[_Record]) -> None:
        if self.outbox is None or not records:
            return
        conn.execute(
            sa.insert(self.outbox),
            [
                {
                    "transactional_id": self.tid,
                    "seq": i,
                    "prepared_txn_state": str(state),
                    "topic": r.topic,
                    "kafka_partition": r.partition,
                    "record_key": r.key,
                    "record_value": r.value,
                    "headers": _encode_headers(r.headers),
                }
                for i, r in enumerate(records)
            ],
        )

    def delete_outbox(self, conn: sa.Connection) -> None:
        """Delete this id's outbox rows in ``conn``'s transaction (the caller records it once that commits)."""
        if self.outbox is not None:
            conn.execute(sa.delete(self.outbox).where(self.outbox.c.transactional_id == self.tid))
