"""The orphan scan: settling the ids whose lease expired (their instance died, paused or was cut off).

:class:`OrphanScanner`, an object the :class:`WriterPool` holds, claims each expired
lease (of instances racing for one, exactly one wins), then recovers the id:
into a slot of this instance when it has room, else through the coordinator
alone (:class:`~kafka2pc.TransactionAdmin`, no producer started), and gives the
lease back.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kafka2pc import PreparedTxnState

from ._core import parse_stored_state
from ._lease import Lease
from ._options import WriterOptions
from ._slots import SlotKeeper, _Slot
from ._store import locked, store_for
from ._values import RecoveryResult

if TYPE_CHECKING:
    from ._runtime import Admins, Event, Runtime

__all__ = ["OrphanScanner"]

logger = logging.getLogger("kafka2pc.recipes.dual_write._pool")  # one logger name for the pool's modules


class OrphanScanner:
    """Finds the ids whose lease expired and settles them, ``settle_parallelism`` at a time.

    Held by a :class:`WriterPool`; an id it settles becomes a slot of the
    pool's :class:`SlotKeeper` when that has room.
    """

    def __init__(
        self, keeper: SlotKeeper, runtime: Runtime, engine: sa.Engine, state_table: sa.Table,
        config: Mapping[str, Any], options: WriterOptions, *, prefix: str, settle_parallelism: int,
        scan_every_s: float, rng: random.Random,
    ) -> None:
        self._keeper = keeper
        self._book = keeper.book
        self._runtime = runtime
        self._engine = engine
        self._state_table = state_table
        self._config = config
        self._options = options
        self._prefix = prefix
        self._settle_parallelism = settle_parallelism
        self.scan_every_s = scan_every_s
        self._random = rng
        self.orphans_settled = 0
        self.orphan_errors = 0
        """Recoveries of an orphaned id that failed (each is retried at the next scan)."""
        self.heuristics = 0
        """Heuristic outcomes found settling an id through the coordinator alone."""

    def settle_orphans(self) -> list[RecoveryResult]:
        """Settle every id whose lease expired (see :meth:`WriterPool.settle_orphans`)."""
        leases = self._book.candidates(limit=100_000, expired_only=True)
        if not leases or self._keeper.closed:
            return []
        self._random.shuffle(leases)  # instances scanning at once start on different ids
        admins = self._runtime.admins(self._config)
        try:
            found = self._runtime.run_each(lambda lease: self._settle_one(lease, admins), leases,
                                           self._settle_parallelism, "k2pc-pool-settle")
        finally:
            admins.close()
        return [r for r in found if r is not None]

    def _settle_one(self, lease: Lease, admins: Admins | None = None) -> RecoveryResult | None:
        claimed = self._book.claim(lease)
        if claimed is None:
            return None  # another instance won the race (or the owner renewed in time)
        logger.warning("%s: lease of %s (epoch %d) expired at %s: recovering it",
                       lease.transactional_id, lease.owner, lease.epoch, lease.expires_at)
        keep = self._keeper.reserve()  # the place is ours while the recovery runs
        if not keep and admins is not None:
            return self._settle_without_producer(lease.transactional_id, claimed.epoch, admins)
        try:
            return self._settle_into_slot(lease.transactional_id, claimed.epoch, keep)
        finally:
            if keep:
                self._keeper.unreserve()

    def _settle_without_producer(self, tid: str, epoch: int, admins: Admins) -> RecoveryResult:
        """The recovery of an id this instance will not keep, through the coordinator (no producer to start).

        The same protocol as the writer's recovery and ``kafka2pc recover``:
        claim the state row (committed before Kafka is touched), complete the
        stored transaction (commit iff it is the one the database committed,
        abort any other), then fence the id's producer (a new epoch), so a
        paused owner that resumes cannot write under it.  A heuristic outcome
        with ``retain_records`` goes through the writer's recovery, which
        re-publishes the retained records.
        """
        from kafka2pc import Decision

        store = store_for(self._engine.dialect, self._state_table)
        lock_timeout_s = self._options.lock_timeout_s
        try:
            with self._engine.connect() as conn, conn.begin():
                claimed = locked(store, tid, "settle an orphaned id (claim the state row)",
                                 lambda: store.claim(conn, tid, lock_timeout_s=lock_timeout_s))
            state = parse_stored_state(tid, self._state_table, claimed.state)
            admin = admins.get()
            settlement = admin.complete_transaction(tid, state, fence=True, on_heuristic="report")
            if settlement.plan.decision is Decision.NOTHING:
                admin.force_terminate_transaction(tid)  # nothing open: fence the old producer all the same
        except Exception as exc:  # noqa: BLE001 - reported in the result and the metrics, retried next scan
            logger.error("%s: recovery of the orphaned id failed (retried at the next scan): %s", tid, exc)
            self.orphan_errors += 1
            self._abandon(tid, epoch)
            return RecoveryResult(tid, PreparedTxnState(), None, error=exc)
        if settlement.heuristic:
            if self._options.retain_records:
                return self._settle_into_slot(tid, epoch, keep=False)
            self.heuristics += 1
            logger.error("HEURISTIC OUTCOME for %r: the database committed %s but Kafka aborted it; recover the id "
                         "with DualWriter(...).recover() to see the details and acknowledge it", tid, state)
        self.orphans_settled += 1
        logger.info("%s: settled (stored %s; %s -> %s)", tid, state, settlement.plan.decision.value,
                    settlement.outcome.value)
        try:
            self._book.release([(tid, epoch)])
        except sa.exc.SQLAlchemyError as exc:
            logger.warning("%s: could not release the lease (it expires by itself): %s", tid, exc)
        return RecoveryResult(tid, state, settlement)

    def _abandon(self, tid: str, epoch: int) -> None:
        try:
            self._book.expire([(tid, epoch)])
        except sa.exc.SQLAlchemyError as exc:
            logger.warning("%s: could not mark the lease expired (it expires by itself): %s", tid, exc)

    def _settle_into_slot(self, tid: str, epoch: int, keep: bool) -> RecoveryResult:
        """The writer's own recovery of an orphaned id; the id becomes a slot if ``keep``."""
        writer, runner = self._keeper.new_writer(tid)
        try:
            result = writer.recover(on_heuristic="report")
        except Exception as exc:  # noqa: BLE001 - reported in the result and the metrics, retried next scan
            logger.error("%s: recovery of the orphaned id failed (retried at the next scan): %s", tid, exc)
            self.orphan_errors += 1
            self._keeper.retire([_Slot(writer, runner, epoch)], abandon=True)
            return RecoveryResult(tid, PreparedTxnState(), None, error=exc)
        self.orphans_settled += 1
        if not (keep and self._keeper.adopt(writer, runner, epoch)):
            self._keeper.retire([_Slot(writer, runner, epoch)])
        return result

    def scan_loop(self, stop: Event) -> None:
        """Settle orphans at once, then every ``scan_every_s`` (0.8 to 1.2 times it), until ``stop`` is set."""
        wait = 0.0
        while not stop.wait(wait):
            try:
                self.settle_orphans()
            except Exception as exc:  # noqa: BLE001 - retried at the next scan
                logger.warning("pool %r: the orphan scan failed: %s", self._prefix, exc)
            wait = self.scan_every_s * self._random.uniform(0.8, 1.2)
