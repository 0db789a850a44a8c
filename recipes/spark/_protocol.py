"""The two-phase-commit coordinator of one sink's batches, shared by both Spark paths.

The ``foreachBatch`` sink (:class:`~kafka2pc.recipes.spark.KafkaTwoPhaseSink`)
and the ``format("kafka2pc")`` data source drive the same protocol: settle
leftovers with the last durable decision, record a decision (the commit
point), complete it through the coordinator, repair partitions Kafka aborted
from a replay of the batch, abort what a failed batch prepared.  They differ
only in how the batch's rows are written (a Spark job the sink starts itself,
or tasks Spark runs for the data source); that part is passed in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from kafka2pc import TransactionAdmin

from ._completion import Completion, complete, repair_mismatch, repair_refusal, settle_open, settle_open_recovery
from ._store import DecisionStore
from ._values import (
    PartitionResult,
    SinkCompletionError,
    SinkDecision,
    SinkRecovery,
    SinkRepairError,
    SinkStep,
    SinkStepHook,
    SinkTransaction,
)

logger = logging.getLogger("kafka2pc.recipes.spark_sink")

Rewrite = Callable[[SinkDecision, frozenset[int], bool], Sequence[PartitionResult]]
"""Write a decided batch's lost partitions again: ``(decision, lost, whole_batch) -> replay results``."""

SECOND_SWEEP_S: Final = 3.0
"""Pause before the second sweep after a failed write job (Spark kills its tasks within its kill timeout, 2 s)."""


@dataclass
class Completed:
    """What completing a decision did: the final revision, the coordinator's answers, repaired partitions."""

    decision: SinkDecision
    completion: Completion
    repaired: list[int]


class SinkCoordinator:
    """One sink's batches under one transactional id base and one decision store (driver side).

    ``sink_id`` is recorded in each decision; partition ``p`` of a batch
    writes under ``<transactional_id_base>-<p>`` (the data source adds the
    slot and the task attempt: see :func:`~._executor.attempt_transactional_id`).
    ``admin`` gives the (lazily built, shared) :class:`~kafka2pc.TransactionAdmin`;
    ``on_step`` is the driver hook called at each :class:`SinkStep`.
    """

    def __init__(
        self,
        admin: Callable[[], TransactionAdmin],
        sink_id: str,
        transactional_id_base: str,
        store: DecisionStore,
        *,
        max_repairs: int = 3,
        decisions_to_retain: int = 100,
        on_step: SinkStepHook | None = None,
    ) -> None:
        self._admin = admin
        self.sink_id = sink_id
        self.transactional_id_base = transactional_id_base
        self.store = store
        self._max_repairs = max_repairs
        self._retain = max(2, decisions_to_retain)
        self._on_step = on_step

    def step(self, step: SinkStep, batch_id: int) -> None:
        """Call the driver hook, if any."""
        if self._on_step is not None:
            self._on_step(step, batch_id)

    def settle_leftovers(self) -> SinkRecovery:
        """Before writing anything: commit what the last decision names, abort every other open transaction."""
        latest = self.store.latest()
        return settle_open_recovery(self._admin(), self.transactional_id_base,
                                    latest.by_transactional_id() if latest is not None else {})

    def decide(self, batch_id: int, results: Sequence[PartitionResult], *, fingerprints: bool = True) -> SinkDecision:
        """Record the decision naming ``results`` durably (the commit point); the hooks run around it."""
        self.step(SinkStep.AFTER_PREPARE, batch_id)
        decision = SinkDecision(
            self.sink_id, batch_id, 0,
            tuple(SinkTransaction(r.partition, r.transactional_id, r.state, r.records,
                                  r.fingerprint if fingerprints else None) for r in results),
            time.time(),
        )
        self.store.put(decision)
        self.step(SinkStep.AFTER_DECISION, batch_id)
        return decision

    def complete(
        self, decision: SinkDecision, rewrite: Rewrite | None, *, keep: frozenset[str] = frozenset()
    ) -> Completed:
        """Commit what ``decision`` names; repair partitions Kafka aborted with ``rewrite``.

        ``keep`` are transactional ids the stray sweep must leave open while
        repairs may still name them (a replay's, prepared before completion).
        Without ``rewrite``, lost partitions are returned in
        ``completion.aborted`` (a replay of the batch repairs them).
        """
        repaired: list[int] = []
        total = Completion()
        admin = self._admin()
        batch_id = decision.batch_id
        for round_ in range(self._max_repairs + 1):
            completion = complete(admin, self.transactional_id_base, decision,
                                  lambda: self.step(SinkStep.MID_COMPLETION, batch_id), keep=keep)
            total.committed += completion.committed
            total.strays_aborted += completion.strays_aborted
            total.visible_at = completion.visible_at
            if not completion.aborted:
                if keep:  # what the replay prepared and no revision named
                    total.strays_aborted += settle_open(admin, self.transactional_id_base,
                                                        decision.by_transactional_id())
                return Completed(decision, total, repaired)
            lost = frozenset(completion.aborted)
            if rewrite is None:  # the caller repairs from a replay, or fails the batch
                total.aborted = sorted(lost)
                return Completed(decision, total, repaired)
            if round_ == self._max_repairs:
                break
            logger.warning(
                "batch %d: Kafka aborted the decided transactions of partitions %s (a late task attempt "
                "re-initialised the id, or the transaction timed out): writing them again",
                batch_id, sorted(lost),
            )
            decision = self.repair(decision, lost, rewrite)
            repaired.extend(sorted(lost))
        raise SinkCompletionError(
            f"batch {batch_id}: partitions {completion.aborted} still aborted after {self._max_repairs} repairs"
        )

    def repair(self, decision: SinkDecision, lost: frozenset[int], rewrite: Rewrite) -> SinkDecision:
        """Record a new revision of ``decision`` naming the rewritten states of the ``lost`` partitions.

        When every decided transaction was aborted, nothing of the batch is
        visible, and the whole batch may be written again in whatever
        partitioning the replay has (its total content must match).  Otherwise
        only the lost partitions are rewritten, and every partition of the
        replay must match what the decision recorded: a different cut would
        lose or duplicate rows.
        """
        whole = lost == {t.partition for t in decision.transactions}
        named = decision.by_transactional_id()
        replay = rewrite(decision, lost, whole)
        problem = repair_mismatch(decision.transactions, replay, whole)
        if problem is not None:
            settle_open(self._admin(), self.transactional_id_base, named)  # what the replay prepared
            raise SinkRepairError(repair_refusal(decision, lost, problem, self.store.location))
        written = {r.partition: r for r in replay if r.written}
        if whole:
            transactions = tuple(
                SinkTransaction(r.partition, r.transactional_id, r.state, r.records, r.fingerprint or None)
                for r in written.values()
            )
        else:
            transactions = tuple(
                SinkTransaction(t.partition, written[t.partition].transactional_id, written[t.partition].state,
                                written[t.partition].records, written[t.partition].fingerprint or None)
                if t.partition in lost else t
                for t in decision.transactions
            )
        repaired = SinkDecision(decision.sink_id, decision.batch_id, decision.revision + 1, transactions,
                                time.time())
        self.store.put(repaired)
        return repaired

    def abort_undecided(self, batch_id: int, named: Mapping[str, SinkTransaction] | None = None) -> int:
        """After a failed write: abort every open transaction no decision names, twice (a late task's too).

        ``named`` defaults to the latest decision's transactions.  A task
        Spark had launched before the job failed may still open its
        transaction after the first sweep (the sweep fences every producer
        it finds, not one that starts later); Spark kills such tasks' Python
        workers within ``spark.python.task.killTimeout`` (2 s): sweep once more.
        """
        if named is None:
            latest = self.store.latest()
            named = latest.by_transactional_id() if latest is not None else {}
        admin = self._admin()
        aborted = settle_open(admin, self.transactional_id_base, named)
        time.sleep(SECOND_SWEEP_S)
        aborted += settle_open(admin, self.transactional_id_base, named)
        logger.warning("batch %d failed before its decision: aborted %d prepared transactions", batch_id, aborted)
        return aborted

    def purge(self, batch_id: int) -> None:
        """Housekeeping every tenth batch: delete decisions older than the ones retained."""
        if batch_id % 10 != 0:
            return
        try:
            gone = self.store.purge(batch_id - self._retain)
            if gone:
                logger.debug("purged %d old decisions", gone)
        except Exception as exc:  # noqa: BLE001 - purging is housekeeping; never fail a batch for it
            logger.warning("could not purge old decisions: %s", exc)
