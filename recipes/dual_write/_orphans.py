"""The orphan scan: settling the ids whose lease expired (their instance died, paused or was cut off).

:class:`OrphanSettling`, a base of :class:`WriterPool`, claims each expired
lease (of instances racing for one, exactly one wins), then recovers the id:
into a slot of this instance when it has room, else through the coordinator
alone (:class:`~kafka2pc.TransactionAdmin`, no producer started), and gives the
lease back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kafka2pc import PreparedTxnState

from ._core import parse_stored_state
from ._lease import Lease
from ._slots import SlotKeeping, _Slot
from ._store import locked, store_for
from ._values import RecoveryResult

if TYPE_CHECKING:
    from kafka2pc import TransactionAdmin

__all__ = ["OrphanSettling"]

logger = logging.getLogger("kafka2pc.recipes.dual_write._pool")  # one logger name for the pool's modules


class _Admins:
    """One :class:`~kafka2pc.TransactionAdmin` per settling thread (a control plane serves one thread)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = config
        self._local = threading.local()
        self._all: list[TransactionAdmin] = []
        self._lock = threading.Lock()

    def get(self) -> TransactionAdmin:
        admin: TransactionAdmin | None = getattr(self._local, "admin", None)
        if admin is None:
            from kafka2pc import TransactionAdmin

            admin = TransactionAdmin(self._config)
            self._local.admin = admin
            with self._lock:
                self._all.append(admin)
        return admin

    def close(self) -> None:
        with self._lock:
            admins, self._all = self._all, []
        for admin in admins:
            admin.close()


class OrphanSettling(SlotKeeping):
    """Settling expired leases' ids: a base of :class:`WriterPool` (which runs :meth:`_orphan_loop`)."""

    _settle_parallelism: int
    _scan_every_s: float

    if TYPE_CHECKING:  # WriterPool's own

        def settle_orphans(self) -> list[RecoveryResult]: ...

    def _settle_each(self, leases: list[Lease], admins: _Admins) -> list[RecoveryResult | None]:
        """:meth:`_settle_one` for every lease, ``settle_parallelism`` at a time."""
        if len(leases) == 1 or self._settle_parallelism == 1:
            return [self._settle_one(lease, admins) for lease in leases]
        with ThreadPoolExecutor(min(self._settle_parallelism, len(leases)),
                                thread_name_prefix="k2pc-pool-settle") as executor:
            return list(executor.map(lambda lease: self._settle_one(lease, admins), leases))

    def _settle_one(self, lease: Lease, admins: _Admins | None = None) -> RecoveryResult | None:
        claimed = self._book.claim(lease)
        if claimed is None:
            return None  # another instance won the race (or the owner renewed in time)
        logger.warning("%s: lease of %s (epoch %d) expired at %s: recovering it",
                       lease.transactional_id, lease.owner, lease.epoch, lease.expires_at)
        with self._cond:
            keep = not self._closed and len(self._slots) + self._acquiring < self._max_slots
            if keep:
                self._acquiring += 1  # the place is ours while the recovery runs
        if not keep and admins is not None:
            return self._settle_without_producer(lease.transactional_id, claimed.epoch, admins)
        try:
            return self._settle_into_slot(lease.transactional_id, claimed.epoch, keep)
        finally:
            if keep:
                with self._cond:
                    self._acquiring -= 1
                    self._cond.notify()

    def _settle_without_producer(self, tid: str, epoch: int, admins: _Admins) -> RecoveryResult:
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
        lock_timeout_s = self._writer_options["lock_timeout_s"]
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
            self._counters.orphan_errors += 1
            self._abandon(tid, epoch)
            return RecoveryResult(tid, PreparedTxnState(), None, error=exc)
        if settlement.heuristic:
            if self._writer_options["retain_records"]:
                return self._settle_into_slot(tid, epoch, keep=False)
            self._counters.heuristics += 1
            logger.error("HEURISTIC OUTCOME for %r: the database committed %s but Kafka aborted it; recover the id "
                         "with DualWriter(...).recover() to see the details and acknowledge it", tid, state)
        self._counters.orphans_settled += 1
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
        writer = self._new_writer(tid)
        try:
            result = writer.recover(on_heuristic="report")
        except Exception as exc:  # noqa: BLE001 - reported in the result and the metrics, retried next scan
            logger.error("%s: recovery of the orphaned id failed (retried at the next scan): %s", tid, exc)
            self._counters.orphan_errors += 1
            self._retire([_Slot(writer, epoch)], abandon=True)
            return RecoveryResult(tid, PreparedTxnState(), None, error=exc)
        self._counters.orphans_settled += 1
        with self._cond:
            keep = keep and not self._closed
            if keep:
                self._slots.append(_Slot(writer, epoch))
                self._cond.notify()
        if not keep:
            self._retire([_Slot(writer, epoch)])
        return result

    def _orphan_loop(self) -> None:
        wait = 0.0
        while not self._stop.wait(wait):
            try:
                self.settle_orphans()
            except Exception as exc:  # noqa: BLE001 - retried at the next scan
                logger.warning("pool %r: the orphan scan failed: %s", self._prefix, exc)
            wait = self._scan_every_s * self._random.uniform(0.8, 1.2)
