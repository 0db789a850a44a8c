"""Lease keeping: this instance's slots (a leased transactional id, its writer), taken, given back and renewed.

A *slot* is an id this instance holds a lease on (:mod:`._lease`) and the
:class:`DualWriter` that runs transactions under it.  :class:`SlotKeeper`,
an object the :class:`WriterPool` holds, hands out a free slot (leasing and recovering a
new id when every slot is busy), takes it back (dropping it when its writer was
fenced), renews the leases and drops the slots whose lease another instance
took.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sqlalchemy as sa

from kafka2pc import IllegalStateError, Kafka2pcError

from ._lease import LeaseBook
from ._lifecycle import WriterState
from ._values import DualWriteMetrics

if TYPE_CHECKING:
    from ._runner import TransactionRunner
    from ._runtime import Event, Runtime
    from ._writer import DualWriter

__all__ = ["PoolExhaustedError", "SlotKeeper"]

logger = logging.getLogger("kafka2pc.recipes.dual_write._pool")  # one logger name for the pool's modules

class PoolExhaustedError(Kafka2pcError):
    """No transactional id could be had in time: every id of the pool is leased and every local slot busy.

    Raised by :meth:`WriterPool.transaction` after ``acquire_timeout_s``.
    Record more ids (``size``) than all instances together run transactions
    at once, or run fewer at once.
    """



@dataclass(eq=False)
class _Slot:
    writer: DualWriter
    runner: TransactionRunner
    """How the pool runs the writer's transactions and recoveries (see :mod:`._runner`)."""
    epoch: int
    busy: bool = False
    lost: bool = False
    freed_at: float = 0.0
    """``time.monotonic()`` when the slot was last given back (0: never used)."""

    @property
    def tid(self) -> str:
        return self.writer.transactional_id


class SlotKeeper:
    """This instance's slots and the leases under them: taken, given back, renewed, dropped when lost.

    Owns the slots, the count of slots being leased now and the condition
    guarding both (held only for in-memory work).  The :class:`WriterPool`
    holds one, and so does its orphan scan (:class:`OrphanScanner`), which
    adds the ids it settles as slots when there is room.
    """

    def __init__(
        self, book: LeaseBook, runtime: Runtime, new_writer: Callable[[str], tuple[DualWriter, TransactionRunner]], *,
        prefix: str, size: int, max_slots: int, lease_s: float, acquire_timeout_s: float, rng: random.Random,
    ) -> None:
        self.book = book
        self._new_writer = new_writer
        self._prefix = prefix
        self._size = size
        self.max_slots = max_slots
        self._lease_s = lease_s
        self._acquire_timeout_s = acquire_timeout_s
        self._random = rng
        self.cond = runtime.condition()
        self.slots: list[_Slot] = []
        self.acquiring = 0
        """Slots being leased and recovered now (they count against ``max_slots``)."""
        self.closed = False
        self._renewed_at = time.monotonic()
        self.retired: list[DualWriteMetrics] = []
        """The metrics of the writers of slots retired (the pool's totals include them)."""
        self.orphans_taken = 0
        """Expired leases this keeper took to make a slot (their recovery settled another instance's id)."""
        self.leases_lost = 0

    def renewed_now(self) -> None:
        """The leases count as renewed now (the pool just recorded its ids)."""
        self._renewed_at = time.monotonic()

    def new_writer(self, tid: str) -> tuple[DualWriter, TransactionRunner]:
        """A writer for ``tid`` and its runner (not a slot yet)."""
        return self._new_writer(tid)

    def held_ids(self) -> list[str]:
        with self.cond:
            return sorted(s.tid for s in self.slots if not s.lost)

    def reserve(self) -> bool:
        """Take a place for a slot being recovered now, if there is room (give it back with :meth:`unreserve`)."""
        with self.cond:
            keep = not self.closed and len(self.slots) + self.acquiring < self.max_slots
            if keep:
                self.acquiring += 1
            return keep

    def unreserve(self) -> None:
        with self.cond:
            self.acquiring -= 1
            self.cond.notify()

    def adopt(self, writer: DualWriter, runner: TransactionRunner, epoch: int) -> bool:
        """Keep ``writer`` (recovered, its lease held at ``epoch``) as a free slot; False once closed."""
        with self.cond:
            if self.closed:
                return False
            self.slots.append(_Slot(writer, runner, epoch))
            self.cond.notify()
            return True

    def close(self, deadline: float) -> list[_Slot]:
        """Refuse new slots, wait (until ``deadline``) for the busy ones, and return every slot (to retire)."""
        with self.cond:
            self.closed = True
            while any(s.busy for s in self.slots) and time.monotonic() < deadline:
                self.cond.wait(max(0.0, deadline - time.monotonic()))
            slots, self.slots = self.slots, []
            self.cond.notify_all()
        return slots

    def drop_all(self) -> None:
        """Forget every slot without closing its writer or touching its lease (a forked child's inheritance)."""
        self.slots = []
        self.acquiring = 0

    def take(self, ready_by: float | None = None) -> _Slot:
        """A free slot (healthy ones first), or a new one leased and recovered by ``ready_by``."""
        if time.monotonic() - self._renewed_at > self._lease_s * 2 / 3:
            self.renew()  # this process was paused or cut off: know which leases are still ours first
        deadline = time.monotonic() + self._acquire_timeout_s
        while True:
            with self.cond:
                while True:
                    if self.closed:
                        raise IllegalStateError(f"pool {self._prefix!r} is closed")
                    # The slot free the longest: its last Kafka commit has had the most time to write
                    # its markers.  A transaction begun on a slot whose EndTxn has just returned has its
                    # AddPartitionsToTxn refused (CONCURRENT_TRANSACTIONS) until they are written, and
                    # librdkafka retries it only after a back-off (measured: a p99 of ~26 ms against
                    # ~13 ms with four writers on eight slots).
                    free = [slot for slot in self.slots if not slot.busy and not slot.lost]
                    if free:
                        # A slot left needing recovery (its broker call failed) is taken last: its
                        # recovery may not finish while the broker is down.
                        chosen = min(free, key=lambda slot: (slot.writer.state is not WriterState.READY,
                                                             slot.freed_at))
                        chosen.busy = True
                        return chosen
                    if len(self.slots) + self.acquiring < self.max_slots:
                        self.acquiring += 1
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self.exhausted()
                    self.cond.wait(left)
            acquired: _Slot | None = None
            try:
                acquired = self.acquire(ready_by)
            finally:
                with self.cond:
                    self.acquiring -= 1
                    if acquired is not None:
                        acquired.busy = True
                        self.slots.append(acquired)
            if acquired is not None:
                return acquired
            with self.cond:  # every id is leased: wait for a slot of ours, or a lease to expire
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.exhausted()
                self.cond.wait(min(left, 0.2))

    def exhausted(self) -> PoolExhaustedError:
        return PoolExhaustedError(
            f"pool {self._prefix!r}: no transactional id free within {self._acquire_timeout_s:g} s (all {self._size} "
            f"ids leased, this instance's {len(self.slots)} slots busy): record more ids (size) or run fewer "
            "transactions at once"
        )

    def acquire(self, ready_by: float | None = None) -> _Slot | None:
        """Lease a free (or expired) id and recover it (by ``ready_by``); ``None`` if every id is leased."""
        candidates = self.book.candidates(limit=16)
        self._random.shuffle(candidates)
        candidates.sort(key=lambda lease: lease.owner is not None)  # free ids first, in random order
        for lease in candidates:
            claimed = self.book.claim(lease)
            if claimed is None:
                continue
            writer, runner = self._new_writer(lease.transactional_id)
            try:
                runner.recover_by(ready_by)
            except BaseException:
                self.retire([_Slot(writer, runner, claimed.epoch)], abandon=True)
                raise
            if lease.owner is not None:
                self.orphans_taken += 1
            return _Slot(writer, runner, claimed.epoch)
        return None

    def give_back(self, slot: _Slot) -> None:
        writer = slot.writer
        drop = slot.lost or writer.state in (WriterState.FENCED, WriterState.CLOSED)
        if drop and not slot.lost:
            try:
                self.renew()  # was the lease taken (this instance presumed dead), or did an operator fence it?
            except sa.exc.SQLAlchemyError as exc:
                logger.debug("%s: cannot read the leases: %s", slot.tid, exc)
        with self.cond:
            slot.busy = False
            slot.freed_at = time.monotonic()
            if drop and slot in self.slots:
                self.slots.remove(slot)
            self.cond.notify()
        if drop:
            if not slot.lost:
                logger.warning("%s: fenced (taken over, or terminated by an operator): dropping the slot", slot.tid)
            # Nothing of ours may be open under it, but another owner's may: leave it to an orphan scan.
            self.retire([slot], abandon=True)

    def retire(self, slots: list[_Slot], *, abandon: bool = False) -> None:
        """Close the writers; release their leases if nothing is open under them, else abandon them."""
        release: list[tuple[str, int]] = []
        expire: list[tuple[str, int]] = []
        for slot in slots:
            self.retired.append(slot.writer.metrics())
            clean = not abandon and not slot.lost and slot.writer.state is WriterState.READY
            if not slot.lost:
                (release if clean else expire).append((slot.tid, slot.epoch))
            slot.writer.close()
        try:
            self.book.release(release)
            self.book.expire(expire)
        except sa.exc.SQLAlchemyError as exc:
            logger.warning("pool %r: could not give leases back (they expire by themselves): %s", self._prefix, exc)


    def renew(self) -> None:
        started = time.monotonic()
        held = self.book.renew()
        self._renewed_at = started
        lost: list[_Slot] = []
        with self.cond:
            for slot in self.slots:
                if not slot.lost and held.get(slot.tid) != slot.epoch:
                    slot.lost = True
                    self.leases_lost += 1
                    logger.error("%s: this instance's lease (epoch %d) was taken over by another instance "
                                 "(this one was presumed dead): dropping the slot", slot.tid, slot.epoch)
                    if not slot.busy:
                        lost.append(slot)
            for slot in lost:
                self.slots.remove(slot)
        if lost:
            self.retire(lost)

    def renew_loop(self, stop: Event) -> None:
        """Renew the leases every ``lease_s / 3`` until ``stop`` is set."""
        while not stop.wait(self._lease_s / 3):
            try:
                self.renew()
            except Exception as exc:  # noqa: BLE001 - the database may be back at the next try
                logger.warning("pool %r: renewing the leases failed: %s", self._prefix, exc)

