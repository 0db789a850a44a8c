"""The abort race: librdkafka's abort against a partition registration still in flight (librdkafka issue #4849).

librdkafka registers a partition with the coordinator (AddPartitionsToTxn)
when the first record for it is sent.  An abort that overtakes that request
fails fatally with INVALID_TXN_STATE, or the coordinator keeps the transaction
``Ongoing`` after the producer has gone.  :func:`settle_registrations` avoids
the race (deliver first, then abort); :func:`end_left_open` ends at the
coordinator what an abort that lost it left open.
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaException, Producer

from kafka2pc._control import ControlPlane
from kafka2pc._deadline import time_left
from kafka2pc._exceptions import Kafka2pcError

__all__ = ["end_left_open", "settle_registrations"]

logger = logging.getLogger("kafka2pc._producer")  # one logger name for the producer's modules


def settle_registrations(producer: Producer, deadline: float) -> bool:
    """Deliver what the transaction produced before aborting it; True if nothing is left in flight.

    A record delivered is a partition registered, so a flush settles the race;
    it gets half the time left before the abort's ``deadline``.
    """
    try:
        return int(producer.flush(max(0.0, (deadline - time.monotonic()) / 2))) == 0
    except (KafkaException, SystemError):  # a fenced or fatal producer: the abort reports it
        return False


def end_left_open(ctrl: ControlPlane, transactional_id: str, producer_id: int, epoch: int, deadline: float) -> None:
    """End what the coordinator still holds open for this producer after its abort (by ``deadline``).

    DescribeTransactions says whether the transaction is still ``Ongoing``; if
    it is this producer's (same ``producer_id`` and ``epoch``: never another
    instance's), EndTxn(abort) ends it.  A failure is logged, not raised: the
    caller's own outcome stands, and the coordinator aborts the transaction at
    its timeout at the latest.
    """
    try:
        op = f"checking the coordinator after aborting {transactional_id!r}"
        with ctrl.deadline(time_left(deadline, op)):
            desc = ctrl.describe_transaction(transactional_id)
            if desc is None or desc.state != "Ongoing":
                return
            if (desc.producer_id, desc.producer_epoch) != (producer_id, epoch):
                logger.warning("%s: the coordinator holds a transaction of producer %d/%d open, not this "
                               "producer's (%d/%d): left alone", transactional_id, desc.producer_id,
                               desc.producer_epoch, producer_id, epoch)
                return
            ctrl.end_txn(transactional_id, desc.producer_id, desc.producer_epoch, commit=False)
    except Kafka2pcError as exc:
        logger.warning("%s: could not check the coordinator after an abort (%s): a transaction left open "
                       "ends at its timeout", transactional_id, exc)
        return
    logger.warning("%s: the coordinator still held the aborted transaction open (producer %d/%d): ended it",
                   transactional_id, desc.producer_id, desc.producer_epoch)
