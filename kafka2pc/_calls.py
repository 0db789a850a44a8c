"""Calls into librdkafka: their failures translated once, and reflected in the transaction state machine.

:class:`LibrdkafkaCalls` is the base of :class:`~kafka2pc.TwoPhaseCommitProducer`
(through :class:`~kafka2pc._anchoring.Anchoring` and
:class:`~kafka2pc._ending.Ending`): the fields every part of the producer
shares, and the one way they call the librdkafka producer.
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

__all__ = ["LibrdkafkaCalls"]


class LibrdkafkaCalls:
    """The producer's shared fields (set by ``TwoPhaseCommitProducer.__init__``) and its calls into librdkafka."""

    _transactional_id: str
    _config: dict[str, Any]
    _ctrl: ControlPlane
    _machine: StateMachine
    _producer: Producer | None
    _producer_id: int
    _epoch: int

    @contextmanager
    def _bounded(self, deadline: float, op: str) -> Iterator[None]:
        """Hold the control-plane calls made in the block to ``deadline``."""
        with self._ctrl.deadline(time_left(deadline, op)):
            yield

    def _failed(self, op: str, exc: KafkaException) -> Kafka2pcError:
        """The kafka2pc error for ``exc``, after moving the state machine to the error state it means."""
        error = translate_confluent_error(exc, f"{op}({self._transactional_id!r})")
        if isinstance(error, FatalError):
            if self._machine.state is not TxnState.FATAL_ERROR:  # poll()/flush() may report it again
                self._machine.transition_to(TxnState.FATAL_ERROR, cause=error)
        elif isinstance(error, AbortableError) and self._machine.state in (TxnState.IN_TRANSACTION, TxnState.PREPARED):
            self._machine.transition_to(TxnState.ABORTABLE_ERROR, cause=error)
        return error

    def _call(self, fn: Callable[[Producer], Any], op: str) -> Any:
        """``fn(producer)``, a librdkafka failure raised as the kafka2pc error it means (:meth:`_failed`)."""
        try:
            return fn(self._require_producer())
        except KafkaException as exc:
            raise self._failed(op, exc) from exc
        except SystemError as exc:
            # confluent-kafka 2.16 (measured): a flush() that meets a fatal error (fenced)
            # sets its KafkaException, then runs delivery callbacks (purged records) with
            # the exception still set.  The interpreter raises SystemError, chained to the
            # KafkaException or (CPython 3.10, in a callback frame) having lost it.
            cause = kafka_exception_in(exc) or self._fatal_error_probe()
            if cause is None:
                raise
            raise self._failed(op, cause) from exc

    def _fatal_error_probe(self) -> KafkaException | None:
        """librdkafka's fatal transaction error, if it is in its fatal state (no side effect).

        Only inside a transaction, where ``begin_transaction()`` cannot succeed: it
        fails with the fatal error in librdkafka's fatal state, with a state error otherwise.
        """
        if self._machine.state not in (TxnState.IN_TRANSACTION, TxnState.PREPARED, TxnState.ABORTABLE_ERROR):
            return None
        try:
            self._require_producer().begin_transaction()
        except KafkaException as exc:
            return exc if exc.args and exc.args[0].fatal() else None
        return None

    def _require_producer(self) -> Producer:
        if self._producer is None:
            raise IllegalStateError(f"no producer in state {self._machine.state.value}: call init_transactions() first")
        return self._producer

