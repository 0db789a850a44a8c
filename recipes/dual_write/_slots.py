"""Lease keeping: this instance's slots (a leased transactional id, its writer), taken, given back and renewed.

A *slot* is an id this instance holds a lease on (:mod:`._lease`) and the
:class:`DualWriter` that runs transactions under it.  :class:`SlotKeeping`,
a base of :class:`WriterPool`, hands out a free slot (leasing and recovering a
new id when every slot is busy), takes it back (dropping it when its writer was
fenced), renews the leases and drops the slots whose lease another instance
took.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from kafka2pc import IllegalStateError, Kafka2pcError

from ._lease import LeaseBook
from ._lifecycle import WriterState
from ._values import DualWriteMetrics, Step
from ._writer import DualWriter

__all__ = ["PoolExhaustedError", "SlotKeeping"]

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
    epoch: int
    busy: bool = False
    lost: bool = False
    freed_at: float = 0.0
    """``time.monotonic()`` when the slot was last given back (0: never used)."""

    @property
    def tid(self) -> str:
        return self.writer.transactional_id


@dataclass
class _Counters:
    orphans_settled: int = 0
    orphan_errors: int = 0
    heuristics: int = 0
    leases_lost: int = 0
    retired: list[DualWriteMetrics] = field(default_factory=list)



class SlotKeeping:
    """The slots of a :class:`WriterPool` and the leases under them (fields set by ``WriterPool.__init__``)."""

    _engine: sa.Engine
    _config: dict[str, Any]
    _prefix: str
    _size: int
    _max_slots: int
    _lease_s: float
    _acquire_timeout_s: float
    _state_table: sa.Table
    _writer_options: dict[str, Any]
    _book: LeaseBook
    _cond: threading.Condition
    _slots: list[_Slot]
    _acquiring: int
    """Slots being leased and recovered now (they count against ``max_slots``)."""
    _counters: _Counters
    _renewed_at: float
    _stop: threading.Event
    _closed: bool
    _random: random.Random
    """This pool's own source of shuffles and jitter: the application's ``random`` stream is not drawn from."""

    _step_observers: list[Callable[[Any, Step], None]]
    """Shared with every writer of the pool (kafka2pc.otel observes the pool's steps through it)."""

    def _new_writer(self, tid: str) -> DualWriter:
        writer = DualWriter(self._engine, {**self._config, "transactional.id": tid},
                            state_table=self._state_table, **self._writer_options)
        writer._step_observers = self._step_observers
        return writer

    def _take(self, ready_by: float | None = None) -> _Slot:
        """A free slot (healthy ones first), or a new one leased and recovered by ``ready_by``."""
        if time.monotonic() - self._renewed_at > self._lease_s * 2 / 3:
            self._renew()  # this process was paused or cut off: know which leases are still ours first
        deadline = time.monotonic() + self._acquire_timeout_s
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        raise IllegalStateError(f"pool {self._prefix!r} is closed")
                    # The slot free the longest: its last Kafka commit has had the most time to write
                    # its markers.  A transaction begun on a slot whose EndTxn has just returned has its
                    # AddPartitionsToTxn refused (CONCURRENT_TRANSACTIONS) until they are written, and
                    # librdkafka retries it only after a back-off (measured: a p99 of ~26 ms against
                    # ~13 ms with four writers on eight slots).
                    free = [slot for slot in self._slots if not slot.busy and not slot.lost]
                    if free:
                        # A slot left needing recovery (its broker call failed) is taken last: its
                        # recovery may not finish while the broker is down.
                        chosen = min(free, key=lambda slot: (slot.writer.state is not WriterState.READY,
                                                             slot.freed_at))
                        chosen.busy = True
                        return chosen
                    if len(self._slots) + self._acquiring < self._max_slots:
                        self._acquiring += 1
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._exhausted()
                    self._cond.wait(left)
            acquired: _Slot | None = None
            try:
                acquired = self._acquire(ready_by)
            finally:
                with self._cond:
                    self._acquiring -= 1
                    if acquired is not None:
                        acquired.busy = True
                        self._slots.append(acquired)
            if acquired is not None:
                return acquired
            with self._cond:  # every id is leased: wait for a slot of ours, or a lease to expire
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._exhausted()
                self._cond.wait(min(left, 0.2))

    def _exhausted(self) -> PoolExhaustedError:
        return PoolExhaustedError(
            f"pool {self._prefix!r}: no transactional id free within {self._acquire_timeout_s:g} s (all {self._size} "
            f"ids leased, this instance's {len(self._slots)} slots busy): record more ids (size) or run fewer "
            "transactions at once"
        )

    def _acquire(self, ready_by: float | None = None) -> _Slot | None:
        """Lease a free (or expired) id and recover it (by ``ready_by``); ``None`` if every id is leased."""
        candidates = self._book.candidates(limit=16)
        self._random.shuffle(candidates)
        candidates.sort(key=lambda lease: lease.owner is not None)  # free ids first, in random order
        for lease in candidates:
            claimed = self._book.claim(lease)
            if claimed is None:
                continue
            writer = self._new_writer(lease.transactional_id)
            deadline = writer._kafka_deadline()
            if ready_by is not None:
                deadline = ready_by if deadline is None else min(deadline, ready_by)
            try:
                writer._recover_by(deadline)
            except BaseException:
                self._retire([_Slot(writer, claimed.epoch)], abandon=True)
                raise
            if lease.owner is not None:
                self._counters.orphans_settled += 1
            return _Slot(writer, claimed.epoch)
        return None

    def _give_back(self, slot: _Slot) -> None:
        writer = slot.writer
        drop = slot.lost or writer.state in (WriterState.FENCED, WriterState.CLOSED)
        if drop and not slot.lost:
            try:
                self._renew()  # was the lease taken (this instance presumed dead), or did an operator fence it?
            except sa.exc.SQLAlchemyError as exc:
                logger.debug("%s: cannot read the leases: %s", slot.tid, exc)
        with self._cond:
            slot.busy = False
            slot.freed_at = time.monotonic()
            if drop and slot in self._slots:
                self._slots.remove(slot)
            self._cond.notify()
        if drop:
            if not slot.lost:
                logger.warning("%s: fenced (taken over, or terminated by an operator): dropping the slot", slot.tid)
            # Nothing of ours may be open under it, but another owner's may: leave it to an orphan scan.
            self._retire([slot], abandon=True)

    def _retire(self, slots: list[_Slot], *, abandon: bool = False) -> None:
        """Close the writers; release their leases if nothing is open under them, else abandon them."""
        release: list[tuple[str, int]] = []
        expire: list[tuple[str, int]] = []
        for slot in slots:
            self._counters.retired.append(slot.writer.metrics())
            clean = not abandon and not slot.lost and slot.writer.state is WriterState.READY
            if not slot.lost:
                (release if clean else expire).append((slot.tid, slot.epoch))
            slot.writer.close()
        try:
            self._book.release(release)
            self._book.expire(expire)
        except sa.exc.SQLAlchemyError as exc:
            logger.warning("pool %r: could not give leases back (they expire by themselves): %s", self._prefix, exc)


    def _renew(self) -> None:
        started = time.monotonic()
        held = self._book.renew()
        self._renewed_at = started
        lost: list[_Slot] = []
        with self._cond:
            for slot in self._slots:
                if not slot.lost and held.get(slot.tid) != slot.epoch:
                    slot.lost = True
                    self._counters.leases_lost += 1
                    logger.error("%s: this instance's lease (epoch %d) was taken over by another instance "
                                 "(this one was presumed dead): dropping the slot", slot.tid, slot.epoch)
                    if not slot.busy:
                        lost.append(slot)
            for slot in lost:
                self._slots.remove(slot)
        if lost:
            self._retire(lost)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self._lease_s / 3):
            try:
                self._renew()
            except Exception as exc:  # noqa: BLE001 - the database may be back at the next try
                logger.warning("pool %r: renewing the leases failed: %s", self._prefix, exc)

