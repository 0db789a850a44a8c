"""How a transaction ends, and how the producer (re)starts with a fresh epoch.

A transaction this process runs ends through librdkafka (:meth:`Ending.end_local`),
delivering first what an abort could race (:mod:`kafka2pc._abort_race`); a
commit or abort that times out leaves the producer ``IN_DOUBT``.  One a
previous instance left open ends at the coordinator (:meth:`Ending.settle_open`).
Either way a re-initialisation (InitProducerId) bumps the epoch, which fences
every older instance and request still in flight.

:class:`Ending` is that collaborator of :class:`~kafka2pc.TwoPhaseCommitProducer`:
it owns the producer id and epoch the coordinator gave this instance, and
whether an abort may have left a transaction open there.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from kafka2pc._abort_race import end_left_open, settle_registrations
from kafka2pc._calls import LibrdkafkaCalls, bounded
from kafka2pc._control import ControlPlane
from kafka2pc._deadline import deadline_after, time_left
from kafka2pc._errors import kafka_error_of, translate_confluent_error
from kafka2pc._exceptions import FatalError, IndefiniteOutcomeError
from kafka2pc._machine import StateMachine, TxnState
from kafka2pc._producer_config import librdkafka_config
from kafka2pc._state import PreparedTxnState

__all__ = ["Ending"]

logger = logging.getLogger("kafka2pc._producer")  # one logger name for the producer's modules

# close() on a producer whose init_transactions failed tries to abort and warns (RuntimeWarning:
# "Producer abort_transaction failed during close"): expected for the producers _discard closes, so
# ignored there, and only there (the filter matches warnings raised from this module).
warnings.filterwarnings(
    "ignore", message="Producer abort_transaction failed during close", category=RuntimeWarning,
    module=r"kafka2pc\._ending$",
)


class Ending:
    """Ends transactions and (re)starts the librdkafka producer (a collaborator of the producer)."""

    def __init__(
        self,
        *,
        transactional_id: str,
        machine: StateMachine,
        calls: LibrdkafkaCalls,
        ctrl: ControlPlane,
        librdkafka: dict[str, Any],
        delivery_callback: Callable[[KafkaError | None, Any], None],
    ) -> None:
        self._transactional_id = transactional_id
        self._machine = machine
        self._calls = calls
        self._ctrl = ctrl
        self._config = librdkafka
        self._delivery_callback = delivery_callback
        """The producer-level delivery callback (librdkafka's default for records sent without one)."""
        self._producer_id = -1
        self._epoch = -1
        self._ids_stale = True
        """The producer id and epoch may have changed since they were last asked of the coordinator."""
        self._abort_doubtful = False
        """The last abort ran with records in flight: the coordinator may still hold it open."""

    @property
    def ids(self) -> tuple[int, int]:
        """``(producer_id, epoch)`` as the coordinator last gave them (``(-1, -1)`` before init)."""
        return self._producer_id, self._epoch

    def start_producer(self, deadline: float) -> None:
        """Create the librdkafka producer and register the transactional id (InitProducerId), by ``deadline``."""
        op = f"init_transactions({self._transactional_id!r})"
        with bounded(self._ctrl, deadline, op):
            config = librdkafka_config(self._config, self._ctrl, self._delivery_callback)
        producer = Producer(config)
        retried = False
        while True:
            try:
                producer.init_transactions(time_left(deadline, op))
                break
            except KafkaException as exc:
                if _worth_retrying(exc, deadline):
                    # A coordinator still loading its partition (it has just moved from a dead broker)
                    # answers COORDINATOR_LOAD_IN_PROGRESS, which librdkafka hands back at once: the
                    # same producer asks again, within the caller's bound.
                    if not retried:
                        logger.info("%s: %s; asking again until the call's deadline", op, exc.args[0])
                    retried = True
                    time.sleep(INIT_RETRY_PAUSE_S)
                    continue
                _discard(producer)
                raise translate_confluent_error(exc, op) from exc
            except BaseException:
                _discard(producer)
                raise
        self._calls.install(producer)
        with bounded(self._ctrl, deadline, op):
            self._refresh_ids()

    def refresh_stale_ids(self, deadline: float) -> None:
        """Ask the coordinator for the producer id and epoch (by ``deadline``) if an abort may have changed them."""
        if self._ids_stale:
            with bounded(self._ctrl, deadline, "prepare_transaction"):
                self._refresh_ids()

    def _refresh_ids(self) -> None:
        """Ask the coordinator for this producer's id and epoch (librdkafka does not tell them)."""
        desc = self._ctrl.describe_transaction(self._transactional_id)
        if desc is None:
            raise FatalError(f"the coordinator does not know {self._transactional_id!r} after init")
        self._producer_id, self._epoch = desc.producer_id, desc.producer_epoch
        self._ids_stale = False

    def reinitialize(self, deadline: float) -> None:
        """Replace the librdkafka producer: a new InitProducerId bumps the epoch and fences older ones."""
        old = self._calls.release()
        if old is not None:
            old.purge()
            del old
        self.start_producer(deadline)
        self._machine.transition_to(TxnState.READY)

    def settle_open(self, *, commit: bool, timeout: float | None) -> None:
        """End at the coordinator the transaction a previous instance left open, then re-initialise."""
        desc = self._ctrl.describe_transaction(self._transactional_id)
        if desc is not None and desc.state == "Ongoing":
            self._ctrl.end_txn(self._transactional_id, desc.producer_id, desc.producer_epoch, commit=commit)
            logger.info("%s: %s the transaction left open by producer %d/%d", self._transactional_id,
                        "committed" if commit else "aborted", desc.producer_id, desc.producer_epoch)
        self.reinitialize(deadline_after(timeout))

    def end_local(self, *, commit: bool, timeout: float | None, prepared: PreparedTxnState | None) -> None:
        """Commit or abort this process's transaction through librdkafka; a timeout leaves it ``IN_DOUBT``.

        ``prepared``: the transaction's prepared state, if it has one (what an
        :class:`IndefiniteOutcomeError` names).
        """
        op = "commit_transaction" if commit else "abort_transaction"
        producer = self._calls.require()
        deadline = deadline_after(timeout)
        registered = True
        if not commit:
            registered = settle_registrations(producer, deadline)
        args = (max(0.001, deadline - time.monotonic()),)
        try:
            producer.commit_transaction(*args) if commit else producer.abort_transaction(*args)
        except KafkaException as exc:
            err = kafka_error_of(exc)
            if not commit and err is not None and err.code() == KafkaError.INVALID_TXN_STATE:
                # The abort lost librdkafka's race: the producer is unusable, the coordinator may hold
                # the transaction open.  End it there, then report the producer's fatal error.
                logger.info("%s: librdkafka's abort failed (%s): ending the transaction at the coordinator",
                            self._transactional_id, err.name())
                self._end_left_open(deadline)
            if err is not None and err.retriable() and not err.fatal() and not err.txn_requires_abort():
                indefinite = IndefiniteOutcomeError(
                    f"{op}() of {prepared or 'the transaction'} timed out: outcome unknown; retry it "
                    "or call complete_transaction(state)",
                    state=prepared, error_name=err.name(), error_code=err.code(),
                )
                self._machine.transition_to(TxnState.IN_DOUBT, cause=indefinite, operation=op)
                raise indefinite from exc
            raise self._calls.failed(op, exc) from exc
        if not commit:
            self._ids_stale = True  # librdkafka may bump the epoch while aborting
            self._abort_doubtful = not registered
        self._machine.transition_to(TxnState.READY)

    def end_doubtful_abort(self, deadline: float) -> None:
        """At close: end what the coordinator may still hold open after an abort that raced its records.

        Only when the last abort ran with records in flight and the producer is
        still ``READY`` with its librdkafka producer; asked by ``deadline``.
        """
        if self._abort_doubtful and self._calls.current is not None and self._machine.state is TxnState.READY:
            self._end_left_open(deadline)

    def _end_left_open(self, deadline: float) -> None:
        """End what the coordinator still holds open for this producer after its abort (:func:`end_left_open`)."""
        self._abort_doubtful = False
        end_left_open(self._ctrl, self._transactional_id, self._producer_id, self._epoch, deadline)


INIT_RETRY_PAUSE_S = 0.25
"""The pause before ``init_transactions`` asks again after a retriable error (a coordinator loading)."""


def _worth_retrying(exc: KafkaException, deadline: float) -> bool:
    """A retriable, non-fatal error other than a timeout, with time left for another attempt."""
    err = kafka_error_of(exc)
    return (
        err is not None and err.retriable() and not err.fatal() and err.code() != KafkaError._TIMED_OUT
        and deadline - time.monotonic() > 2 * INIT_RETRY_PAUSE_S
    )


def _discard(producer: Producer) -> None:
    """Destroy a librdkafka producer whose ``init_transactions`` failed, without waiting for it.

    Left alone (a traceback keeps it alive), librdkafka goes on retrying its
    InitProducerId; one that lands after the next instance's bumps the epoch
    and fences that instance, which then fails with ``ProducerFencedError``.
    """
    def close() -> None:
        try:
            producer.close()
        except Exception as exc:  # noqa: BLE001 - nothing depends on it: the instance was never used
            logger.debug("closing a producer whose init_transactions failed: %r", exc)

    threading.Thread(target=close, name="kafka2pc-discard-producer", daemon=True).start()
