"""What the writer's normal path and its recovery share: the writer's fields and small helpers."""

from __future__ import annotations

import logging
import threading
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

from ._lifecycle import WriterState, check_transition
from ._store import StateStore
from ._topics import TopicCheck
from ._values import Step, StepHook, _encode_headers, _Record

if TYPE_CHECKING:
    from kafka2pc import TwoPhaseCommitProducer

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
    """The fields of a :class:`DualWriter` (set by its ``__init__``) and the helpers every path uses."""

    _engine: sa.Engine
    _config: dict[str, Any]
    _tid: str
    _table: sa.Table
    _outbox: sa.Table | None
    _retain: bool
    _lock_timeout_s: float | None
    _on_step: StepHook | None
    _step_observers: list[Callable[[Any, Step], None]]
    """Called with ``(writer, step)`` at every step before ``_on_step`` (kafka2pc.otel's hook; a pool's
    writers share their pool's list)."""
    _settle_attempts: int
    _queue_full_timeout_s: float
    _kafka_timeout_s: float | None
    _store: StateStore
    _serial: threading.Lock
    _owner: int | None
    _status: WriterState
    _producer: TwoPhaseCommitProducer | None
    _last_state: str | None
    """The stored state as this writer (or its recovery) last committed it."""
    _token: str | None
    """The state row's version as this writer (or its recovery) last committed it (see ``_store``)."""
    _outbox_dirty: bool
    """The outbox may hold rows of this id (deleted by the next transaction)."""
    _open_since: float | None
    _in_doubt: PreparedTxnState | None
    _in_doubt_since: float | None
    _committed: int
    _rolled_back: int
    _recoveries: int
    _heuristics: int
    _republished: int
    _topics: TopicCheck

    def _to(self, target: WriterState) -> None:
        check_transition(self._tid, self._status, target)
        self._status = target

    def _step(self, step: Step) -> None:
        for observe in self._step_observers:
            observe(self, step)
        if self._on_step is not None:
            self._on_step(step)

    def _kafka(self, call: Callable[[], _T]) -> _T:
        """A producer call; an error that is not a kafka2pc one (librdkafka's binding can raise a bare
        ``SystemError`` from ``flush`` on a fenced producer) becomes :class:`~kafka2pc.FatalError`."""
        try:
            return call()
        except Kafka2pcError:
            raise
        except Exception as exc:
            raise FatalError(f"{self._tid!r}: the producer failed: {exc!r}") from exc

    # -- what the asyncio writer (recipes/dual_write/aio) answers differently -----------
    def _new_producer(self) -> TwoPhaseCommitProducer:
        """A new producer for this writer's transactional id (each recovery makes one)."""
        from kafka2pc import TwoPhaseCommitProducer

        return TwoPhaseCommitProducer(self._config)

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` between two attempts."""
        time.sleep(seconds)

    def _blocking(self, call: Callable[[], _T]) -> _T:
        """Run a call that waits on the network but on neither the producer nor the database (a
        recovery plan, a transaction's outcome read from the control plane)."""
        return call()

    def _produce(self, producer: TwoPhaseCommitProducer, topic: str, kwargs: dict[str, Any]) -> None:
        """Produce one record; a full local queue is waited out for up to ``queue_full_timeout_s``."""
        if topic not in self._topics.known:
            self._topics.require(topic, self._tid)
        deadline: float | None = None
        while True:
            try:
                producer.produce(topic, **kwargs)
                return
            except QueueFullError:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self._queue_full_timeout_s
                elif now > deadline:
                    raise
                producer.poll(0.05)
            except Kafka2pcError:
                raise
            except Exception as exc:  # as _kafka(): a bare error of the binding is fatal
                raise FatalError(f"{self._tid!r}: the producer failed: {exc!r}") from exc

    def _parse(self, stored: str | None) -> PreparedTxnState:
        return parse_stored_state(self._tid, self._table, stored, then=", then recover()")

    def _fenced_error(self, detail: str) -> ProducerFencedError:
        if self._status is not WriterState.FENCED:
            self._to(WriterState.FENCED)
        return ProducerFencedError(
            f"{self._tid!r}: {detail}: another instance (or an operator's `kafka2pc recover`) took over the "
            "transactional id; this transaction is rolled back on both sides and this writer stops "
            "(recover() takes over again)"
        )

    def _taken_over_now(self) -> bool:
        """True when the state row no longer carries this writer's token (read in a new connection)."""
        token = self._token
        if token is None:
            return False
        try:
            with self._engine.connect() as conn:
                return self._store.version(conn, self._tid) != token
        except sa.exc.SQLAlchemyError:
            logger.debug("%s: cannot read the state row's version", self._tid, exc_info=True)
            return False

    def _insert_outbox(self, conn: sa.Connection, state: PreparedTxnState, records: list[_Record]) -> None:
        if self._outbox is None or not records:
            return
        conn.execute(
            sa.insert(self._outbox),
            [
                {
                    "transactional_id": self._tid,
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

    def _delete_outbox(self, conn: sa.Connection) -> None:
        """Delete this id's outbox rows in ``conn``'s transaction (the caller records it once that commits)."""
        if self._outbox is not None:
            conn.execute(sa.delete(self._outbox).where(self._outbox.c.transactional_id == self._tid))
