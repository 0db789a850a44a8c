"""Fault injection for the sink's tests: a task hook that fails attempts or runs duplicate ones.

A testing aid, never used unless passed in through the private seams:
:func:`inject_task_hook` for a :class:`~kafka2pc.recipes.spark.KafkaTwoPhaseSink`,
the ``_task_hook`` class attribute of a ``Kafka2pcDataSource`` subclass.  It is
a picklable value, so it reaches the executors with the writer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ._driver import inject_task_hook as inject_task_hook  # the seam lives with the sink it sets
from ._executor import TaskPoint, TaskStep, open_producer, produce_batch

logger = logging.getLogger("kafka2pc.recipes.spark_sink")


@dataclass(frozen=True)
class FaultInjection:
    """Task faults for tests (a task hook); never set in production.

    ``fail_task_at="after_prepare"`` makes attempts numbered below
    ``fail_task_attempts`` raise right after preparing (their transaction stays
    open, as after an executor crash).  ``duplicate_attempt`` runs a second
    writer of the same partition under the same transactional id inside
    attempt 0, as speculative execution would: ``"fences_original"`` starts it
    right after the original opened its transaction (it fences the original,
    whose writes must then fail, so Spark retries the task) and
    ``"after_prepare"`` starts it after the original prepared (a late copy: its
    ``init_transactions`` aborts the original's prepared transaction, and it
    leaves its own open; the original still reports success).
    ``fail_partitions`` and ``task_batch`` limit the faults to those
    partition indexes and that batch.  Repair runs never get task faults.

    Driver crashes are not injected here: pass ``on_step=`` to the sink.
    """

    fail_task_at: str | None = None
    fail_task_attempts: int = 1
    duplicate_attempt: str | None = None
    fail_partitions: tuple[int, ...] | None = None
    task_batch: int | None = None

    def task_fault(self, batch_id: int, partition: int, attempt: int) -> bool:
        """Does this task attempt get the task faults?"""
        if self.task_batch is not None and self.task_batch != batch_id:
            return False
        return self.fail_partitions is None or partition in self.fail_partitions

    def __call__(self, point: TaskPoint) -> None:
        """The task hook."""
        if not self.task_fault(point.spec.batch_id, point.partition, point.attempt):
            return
        if point.attempt == 0 and point.step.value == _DUPLICATE_AT.get(self.duplicate_attempt or ""):
            _duplicate_attempt(point)
        if (point.step is TaskStep.PREPARED and self.fail_task_at == "after_prepare"
                and point.attempt < self.fail_task_attempts):
            raise RuntimeError(f"kafka2pc fault injection: task for partition {point.partition} attempt "
                               f"{point.attempt} fails after prepare")


_DUPLICATE_AT = {"fences_original": TaskStep.OPENED.value, "after_prepare": TaskStep.PREPARED.value}


def _duplicate_attempt(point: TaskPoint) -> None:
    """A second attempt of the same partition, as speculation would run (its result is dropped)."""
    logger.warning("fault injection: duplicate attempt of partition %d", point.partition)
    producer = open_producer(point.spec, point.partition)
    for batch in point.rows:
        produce_batch(producer, point.spec, batch)
    producer.prepare_transaction()
    producer.close()  # a zombie: prepared and abandoned
