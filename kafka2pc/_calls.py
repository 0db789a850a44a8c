"""Calls into librdkafka: their failures translated once, and reflected in the transaction state machine.

:class:`LibrdkafkaCalls` is one collaborator of :class:`~kafka2pc.TwoPhaseCommitProducer`:
it holds the librdkafka producer (``None`` before ``init_transactions`` and
after ``close``) and is the one way the producer and its other collaborators
(:class:`~kafka2pc._anchoring.Anchoring`, :class:`~kafka2pc._ending.Ending`)
call it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from confluent_kafka import KafkaException, Producer

from kafka2pc._control import ControlPlane
from kafka2pc._deadline import time_left
from kafka2pc._errors import kafka_exception_in, translate_confluent_error
from kafka2pc._exceptions import AbortableError, FatalError, IllegalStateError, Kafka2pcError
from kafka2pc._machine import StateMachine, TxnState

__all__ = ["LibrdkafkaCalls", "bounded"]


@contextmanager
def bounded(ctrl: ControlPlane, deadline: float, op: str) -> Iterator[None]:
    """Hold the control-plane calls made in the block to ``deadline`` (a :func:`time.monotonic` value)."""
    with ctrl.deadline(time_left(deadline, op)):
        yield


class LibrdkafkaCalls:
    """The librdkafka producer of one transactional id, and the one way to call it.

    A failure is translated to the kafka2pc error it means, after moving the
    shared state machine to the error state it implies (:meth:`failed`).
    """

    def __init__(self, transactional_id: str, machine: StateMachine) -> None:
        self._transactional_id = transactional_id
        self._machine = machine
        self._producer: Producer | None = None

    @property
    def current(self) -> Producer | None:
        """The librdkafka producer, ``None`` when there is none (before init, after close)."""
        return self._producer

    def install(self, producer: Producer) -> None:
        """Make ``producer`` (initialised) the one every call goes to."""
        self._producer = producer

    def release(self) -> Producer | None:
        """Forget the librdkafka producer and hand it to the caller (to purge, flush or drop)."""
        producer, self._producer = self._producer, None
        return producer

    def outstanding(self) -> int:
        """Records and requests librdkafka still holds (``len(producer)``; ``0`` without a producer)."""
        return len(self._producer) if self._producer is not None else 0

    def failed(self, op: str, exc: KafkaException) -> Kafka2pcError:
        """The kafka2pc error for ``exc``, after moving the state machine to the error state it means."""
        error = translate_confluent_error(exc, f"{op}({self._transactional_id!r})")
        if isinstance(error, FatalError):
            if self._machine.state is not TxnState.FATAL_ERROR:  # poll()/flush() may report it again
                self._machine.transition_to(TxnState.FATAL_ERROR, cause=error)
        elif isinstance(error, AbortableError) and self._machine.state in (TxnState.IN_TRANSACTION, TxnState.PREPARED):
            self._machine.transition_to(TxnState.ABORTABLE_ERROR, cause=error)
        return error

    def call(self, fn: Callable[[Producer], Any], op: str) -> Any:
        """``fn(producer)``, a librdkafka failure raised as the kafka2pc error it means (:meth:`failed`)."""
        try:
            return fn(self.require())
        except KafkaException as exc:
            raise self.failed(op, exc) from exc
        except SystemError as exc:
            # confluent-kafka 2.16 (measured): a flush() that meets a fatal error (fenced)
            # sets its KafkaException, then runs delivery callbacks (purged records) with
            # the exception still set.  The interpreter raises SystemError, chained to the
            # KafkaException or (CPython 3.10, in a callback frame) having lost it.
            cause = kafka_exception_in(exc) or self._fatal_error_probe()
            if cause is None:
                raise
            raise self.failed(op, cause) from exc

    def require(self) -> Producer:
        """The librdkafka producer; :class:`IllegalStateError` when there is none."""
        if self._producer is None:
            raise IllegalStateError(f"no producer in state {self._machine.state.value}: call init_transactions() first")
        return self._producer

    def _fatal_error_probe(self) -> KafkaException | None:
        """librdkafka's fatal transaction error, if it is in its fatal state (no side effect).

        Only inside a transaction, where ``begin_transaction()`` cannot succeed: it
        fails with the fatal error in librdkafka's fatal state, with a state error otherwise.
        """
        if self._machine.state not in (TxnState.IN_TRANSACTION, TxnState.PREPARED, TxnState.ABORTABLE_ERROR):
            return None
        try:
            self.require().begin_transaction()
        except KafkaException as exc:
            return exc if exc.args and exc.args[0].fatal() else None
        return None
