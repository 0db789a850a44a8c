"""A pool of dual writers over a bounded set of leased transactional ids (no hand-made ids).

Instances that share a database draw their transactional ids from one set
recorded in it (:mod:`._lease`).  Each instance holds a few of them, one per
concurrent transaction (a *slot*: a :class:`DualWriter` with its own
producer), renews its leases in the background, and settles the ids of
instances that stopped renewing (*orphans*).  Taking an id over is always the
writer's claim-before-Kafka recovery, so the lease only decides who recovers
and when; safety comes from the state row and Kafka's fencing, as with fixed ids.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kafka2pc import IllegalStateError, InvalidPreparedStateError, Kafka2pcError, PreparedTxnState, UsageError
from kafka2pc._deprecation import seconds_from_ms

from ._handle import DualWriteTransaction
from ._lease import Lease, LeaseBook
from ._lease import define_lease_table as _make_lease_table
from ._lifecycle import WriterState
from ._pipeline import CommitPipeline, InFlightCommit
from ._schema import create_state_table
from ._schema import define_state_table as _make_state_table
from ._store import locked, store_for
from ._values import DualWriteMetrics, RecoveryResult, StepHook
from ._writer import DualWriter

if TYPE_CHECKING:
    from typing_extensions import Self

    from kafka2pc import TransactionAdmin

    from ._bind import Bind

__all__ = ["PoolExhaustedError", "PoolMetrics", "WriterPool"]

logger = logging.getLogger(__name__)


class PoolExhaustedError(Kafka2pcError):
    """No transactional id could be had in time: every id of the pool is leased and every local slot busy.

    Raised by :meth:`WriterPool.transaction` after ``acquire_timeout_s``.
    Record more ids (``size``) than all instances together run transactions
    at once, or run fewer at once.
    """


@dataclass(frozen=True)
class PoolMetrics:
    """A point-in-time snapshot of a :class:`WriterPool` (no I/O).

    ``transactions`` aggregates the pool's writers (past and present):
    alert on its ``oldest_open_transaction_age_s``, ``in_doubt_transactions``
    and ``heuristic_outcomes`` as for a single writer.  Pool-specific:
    ``orphan_recovery_errors`` (an orphan that could not be settled is retried
    every scan, and holds back consumers meanwhile) and, with pipelined
    commits, ``oldest_commit_in_flight_age_s`` and ``slow_commits``.
    """

    transactions: DualWriteMetrics
    leases_held: int
    """Ids this instance holds (its slots)."""
    slots_busy: int
    """Slots in a transaction or committing."""
    orphans_settled: int
    """Ids of other (dead) instances this one settled."""
    orphan_recovery_errors: int
    leases_lost: int
    """Leases another instance took from this one (this instance was presumed dead: paused, cut off)."""
    commits_in_flight: int
    """Pipelined Kafka commits not finished yet (database committed)."""
    oldest_commit_in_flight_age_s: float | None
    slow_commits: int
    """Pipelined Kafka commits that took longer than ``slow_commit_s``."""


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


def _default_owner() -> str:
    return f"{socket.gethostname()[:120]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


class WriterPool:
    """Dual writers for many instances sharing one database, with transactional ids from a leased set.

    ``prefix`` names the pool: its ids are ``<prefix>-0`` .. ``<prefix>-<size-1>``,
    recorded in the lease table (:func:`define_lease_table`) of ``engine``'s database,
    which also holds the state table.  Every instance of the service creates a
    ``WriterPool`` with the same ``prefix`` and ``size``; ``size`` must cover
    the transactions all instances run at once (ids are reused, never
    churned: each distinct id costs the brokers memory until
    ``transactional.id.expiration.ms``).

    Each concurrent transaction of this process gets its own slot (a
    :class:`DualWriter` on a leased id, with its own producer), up to
    ``max_slots``; slots are kept and reused.  A lease lasts ``lease_s``
    seconds and is renewed every ``lease_s / 3``.  Every ``scan_every_s``
    (default ``lease_s / 3``) the pool looks for leases that expired (their
    owner died or was cut off) and settles them, ``settle_parallelism`` at a
    time: claim the lease (its fencing epoch goes up), then the writer's
    recovery (claim the state row, fence the old producer, commit or abort
    the transaction it left, per the state the database stored).  So a
    killed instance holds back ``read_committed`` consumers for at most about
    ``lease_s + scan_every_s`` plus the recovery.

    ``pipelined=True`` completes each Kafka commit in the background once
    the database COMMIT is durable (see :meth:`transaction`).

    ``producer_config`` is a confluent-kafka configuration without
    ``transactional.id``.  ``retain_records``, ``lock_timeout_s`` (default:
    the lease, capped at 10 s, so that a recovery never waits on a paused
    instance's row lock for longer), ``kafka_timeout_s`` and ``on_step`` are
    passed to every writer, as :class:`DualWriter` documents them.

    Example::

        pool = WriterPool(engine, {"bootstrap.servers": "kafka:9092"}, prefix="orders", size=32)
        with Session(engine) as session, pool.transaction(session) as tx:
            session.add(Order(id=42))
            tx.produce("orders", key=b"42", value=b"created")
        pool.close()
    """

    def __init__(
        self,
        engine: sa.Engine,
        producer_config: Mapping[str, Any],
        *,
        prefix: str,
        size: int,
        max_slots: int | None = None,
        lease_s: float = 15.0,
        scan_every_s: float | None = None,
        acquire_timeout_s: float = 30.0,
        settle_parallelism: int = 8,
        pipelined: bool = False,
        max_in_flight: int | None = None,
        slow_commit_s: float = 1.0,
        state_table: sa.Table | None = None,
        lease_table: sa.Table | None = None,
        owner: str | None = None,
        retain_records: bool = False,
        lock_timeout_s: float | None = None,
        kafka_timeout_s: float | None = None,
        on_step: StepHook | None = None,
        start: bool = True,
        lock_timeout_ms: int | None = None,
    ) -> None:
        """As the class documents; ``lock_timeout_ms`` is the deprecated spelling of ``lock_timeout_s``."""
        lock_timeout_s = seconds_from_ms(type(self).__name__, "lock_timeout_ms", lock_timeout_ms,
                                         "lock_timeout_s", lock_timeout_s)
        if "transactional.id" in producer_config:
            raise UsageError("a WriterPool leases its transactional ids: remove 'transactional.id' from the config")
        if not isinstance(prefix, str) or not prefix or len(prefix) + 1 + len(str(max(size, 1) - 1)) > 255:
            raise UsageError("prefix must be a non-empty string; '<prefix>-<n>' must fit VARCHAR(255)")
        if size < 1:
            raise UsageError("size (the number of transactional ids of the pool) must be at least 1")
        if max_slots is None:
            max_slots = min(size, 8)
        if not 1 <= max_slots <= size:
            raise UsageError(f"max_slots must be between 1 and size ({size}), not {max_slots}")
        if lease_s <= 0 or (scan_every_s is not None and scan_every_s <= 0) or acquire_timeout_s < 0:
            raise UsageError("lease_s and scan_every_s must be positive, acquire_timeout_s not negative")
        if settle_parallelism < 1:
            raise UsageError("settle_parallelism must be at least 1")
        if max_in_flight is not None and max_in_flight < 1:
            raise UsageError("max_in_flight must be at least 1")
        self._engine = engine
        self._config = dict(producer_config)
        self._prefix = prefix
        self._size = size
        self._max_slots = max_slots
        self._lease_s = float(lease_s)
        self._scan_every_s = float(scan_every_s) if scan_every_s is not None else self._lease_s / 3
        self._acquire_timeout_s = acquire_timeout_s
        self._settle_parallelism = settle_parallelism
        metadata = sa.MetaData()
        self._state_table = state_table if state_table is not None else _make_state_table(metadata)
        self._lease_table = lease_table if lease_table is not None else _make_lease_table(metadata)
        self._owner = owner or _default_owner()
        self._writer_options: dict[str, Any] = {
            "retain_records": retain_records,
            "lock_timeout_s": lock_timeout_s if lock_timeout_s is not None else min(self._lease_s, 10.0),
            "kafka_timeout_s": kafka_timeout_s,
            "on_step": on_step,
        }
        self._book = LeaseBook(engine, self._lease_table, prefix, self._owner, self._lease_s)
        self._cond = self._new_condition()
        self._slots: list[_Slot] = []
        self._acquiring = 0
        self._counters = _Counters()
        self._renewed_at = time.monotonic()
        self._stop = self._new_event()
        self._threads: list[threading.Thread] = []
        self._started = False
        self._closed = False
        self._pipeline = CommitPipeline(
            max_in_flight if max_in_flight is not None else max_slots, slow_commit_s
        ) if pipelined else None
        if start:
            self.start()

    # -- introspection ---------------------------------------------------------------
    @property
    def prefix(self) -> str:
        """The pool's name: its ids are ``<prefix>-0`` .. ``<prefix>-<size-1>``."""
        return self._prefix

    @property
    def owner(self) -> str:
        """This instance's name in the lease table (host, pid and a random part)."""
        return self._owner

    @property
    def transactional_ids(self) -> list[str]:
        """Every id of the pool (all instances)."""
        return self._book.ids(self._size)

    @property
    def held_ids(self) -> list[str]:
        """The ids this instance holds now (its slots)."""
        with self._cond:
            return sorted(s.tid for s in self._slots if not s.lost)

    @property
    def lease_table(self) -> sa.Table:
        """The lease table."""
        return self._lease_table

    @property
    def state_table(self) -> sa.Table:
        """The state table the pool's writers use."""
        return self._state_table

    def leases(self) -> list[Lease]:
        """Every lease of the pool as the database has it (one query)."""
        return self._book.read()

    def create_tables(self) -> None:
        """Create the state and lease tables if missing: a convenience for scripts and tests."""
        create_state_table(self._engine, self._state_table)
        self._lease_table.create(self._engine, checkfirst=True)

    def metrics(self) -> PoolMetrics:
        """A snapshot of the pool (no I/O; safe from any thread)."""
        with self._cond:
            slots = list(self._slots)
            retired = list(self._counters.retired)
        pipeline = self._pipeline
        writers = DualWriteMetrics.aggregate([s.writer.metrics() for s in slots] + retired)
        return PoolMetrics(
            transactions=dataclasses.replace(
                writers, heuristic_outcomes=writers.heuristic_outcomes + self._counters.heuristics
            ),
            leases_held=sum(not s.lost for s in slots),
            slots_busy=sum(s.busy for s in slots),
            orphans_settled=self._counters.orphans_settled,
            orphan_recovery_errors=self._counters.orphan_errors,
            leases_lost=self._counters.leases_lost,
            commits_in_flight=pipeline.in_flight if pipeline else 0,
            oldest_commit_in_flight_age_s=pipeline.oldest_age_s() if pipeline else None,
            slow_commits=pipeline.slow_commits if pipeline else 0,
        )

    # -- life cycle ------------------------------------------------------------------
    def start(self) -> None:
        """Record the pool's ids (the missing ones), then start renewing leases and settling orphans.

        Called by the constructor unless ``start=False``.  The first orphan
        scan runs at once, in the background.
        """
        if self._started:
            return
        self._book.ensure(self._size)
        self._started = True
        self._renewed_at = time.monotonic()
        self._start_background()

    def close(self, timeout: float = 30.0) -> None:
        """Drain the pipelined commits, then give the leases back.

        A lease whose writer has nothing open is released (any instance may
        take it at once); one whose transaction is still open or in doubt is
        left to expire, so that an orphan scan recovers it.  Waits up to
        ``timeout`` for transactions running in other threads.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._pipeline is not None:
            self._pipeline.drain(timeout)
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(s.busy for s in self._slots) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            slots, self._slots = self._slots, []
            self._cond.notify_all()
        self._join_background(deadline)
        if self._pipeline is not None:
            self._pipeline.close()
        self._retire(slots)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- transactions ----------------------------------------------------------------
    @contextmanager
    def transaction(self, bind: Bind, *, wait_visible: bool = False) -> Iterator[DualWriteTransaction]:
        """Run one atomic database + Kafka transaction on ``bind`` (a Session or a Connection), on a free slot.

        As :meth:`DualWriter.transaction`, on one of this instance's slots
        (leasing and recovering a new id when all are busy and fewer than
        ``max_slots`` exist; waiting up to ``acquire_timeout_s`` otherwise,
        then :class:`PoolExhaustedError`).  A :class:`~kafka2pc.ProducerFencedError`
        means this instance lost that id (another one took it over after the
        lease expired, or an operator fenced it): the transaction rolled back
        on both sides, the slot is dropped and the next transaction runs on another.

        Pipelined pools (``pipelined=True``) return as soon as the database
        COMMIT is durable: the outcome is decided then, and the Kafka commit
        completes in the background on the slot's producer while the next
        transaction runs on another slot.  Its records become visible to
        ``read_committed`` consumers a moment later; ``wait_visible=True`` (or
        :meth:`wait_visible`) waits for that.
        """
        if self._closed:
            raise IllegalStateError(f"pool {self._prefix!r} is closed")
        ready_by = time.monotonic() + self._acquire_timeout_s if self._acquire_timeout_s > 0 else None
        slot = self._take(ready_by)
        handed_off: InFlightCommit | None = None
        try:
            if self._pipeline is None:
                with slot.writer._transaction_deferred(bind, None, ready_by=ready_by) as tx:
                    yield tx
            else:
                pipeline = self._pipeline

                def defer(commit: Callable[[], None]) -> None:
                    nonlocal handed_off
                    handed_off = pipeline.submit(slot.tid, commit, lambda: self._give_back(slot))

                with slot.writer._transaction_deferred(bind, defer, ready_by=ready_by) as tx:
                    yield tx
        finally:
            if handed_off is None:
                self._give_back(slot)
        if handed_off is not None and wait_visible:
            handed_off.wait()

    def wait_visible(self, timeout: float | None = None) -> None:
        """Wait until every transaction this pool committed so far is visible to ``read_committed`` readers.

        Read-your-writes on Kafka for a pipelined pool (a no-op otherwise).
        Raises the error of a background commit that failed
        (:class:`~kafka2pc.IndefiniteOutcomeError`: the database committed and
        the recovery of that id will commit Kafka; do not redo it), and
        :class:`TimeoutError` after ``timeout``.
        """
        if self._pipeline is not None:
            self._pipeline.wait_all(timeout)

    # -- orphans -----------------------------------------------------------------------
    def settle_orphans(self) -> list[RecoveryResult]:
        """Settle now every id whose lease expired (its owner died or was cut off); what each recovery found.

        The orphan scan runs this every ``scan_every_s`` by itself.  For each
        expired lease, ``settle_parallelism`` at a time: claim it (of
        instances racing for one lease exactly one wins; the others skip it),
        then the writer's recovery on that id.  The id then becomes a slot of
        this instance if it has fewer than ``max_slots``, and is released
        otherwise.  A recovery that fails (``result.error``) leaves the lease
        expired, for the next scan.
        """
        leases = self._book.candidates(limit=100_000, expired_only=True)
        if not leases or self._closed:
            return []
        random.shuffle(leases)  # instances scanning at once start on different ids
        admins = self._new_admins()
        try:
            found = self._settle_each(leases, admins)
        finally:
            admins.close()
        return [r for r in found if r is not None]

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
            state = self._parse_state(tid, claimed.state)
            admin = admins.get()
            settlement = admin.complete_transaction(tid, state, fence=True, raise_on_heuristic=False)
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

    def _parse_state(self, tid: str, stored: str | None) -> PreparedTxnState:
        try:
            return PreparedTxnState(stored) if stored else PreparedTxnState()
        except InvalidPreparedStateError as exc:
            raise InvalidPreparedStateError(
                f"{tid!r}: the state row in {self._state_table.name} holds a malformed prepared state {stored!r} "
                f"({exc}); fix or clear it (an operator decision)"
            ) from exc

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

    # -- slots -----------------------------------------------------------------------------
    def _new_writer(self, tid: str) -> DualWriter:
        return DualWriter(self._engine, {**self._config, "transactional.id": tid},
                          state_table=self._state_table, **self._writer_options)

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
                        chosen = min(free, key=lambda slot: (slot.writer.status is not WriterState.READY,
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
        random.shuffle(candidates)
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
        drop = slot.lost or writer.status in (WriterState.FENCED, WriterState.CLOSED)
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
            clean = not abandon and not slot.lost and slot.writer.status is WriterState.READY
            if not slot.lost:
                (release if clean else expire).append((slot.tid, slot.epoch))
            slot.writer.close()
        try:
            self._book.release(release)
            self._book.expire(expire)
        except sa.exc.SQLAlchemyError as exc:
            logger.warning("pool %r: could not give leases back (they expire by themselves): %s", self._prefix, exc)

    # -- what the asyncio pool (recipes/dual_write/aio) answers differently ---------------
    def _new_condition(self) -> threading.Condition:
        """The condition guarding the slots (held only for in-memory work; waited on for a free slot)."""
        return threading.Condition()

    def _new_event(self) -> threading.Event:
        """The stop signal of the background loops (their pause between two rounds is its ``wait``)."""
        return threading.Event()

    def _new_admins(self) -> _Admins:
        """The admins one orphan scan settles ids through (closed at the end of the scan)."""
        return _Admins(self._config)

    def _start_background(self) -> None:
        """Start :meth:`_renew_loop` and :meth:`_orphan_loop` (a thread each)."""
        for name, loop in (("renew", self._renew_loop), ("orphans", self._orphan_loop)):
            thread = threading.Thread(target=loop, name=f"k2pc-pool-{name}-{self._prefix}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _join_background(self, deadline: float) -> None:
        """Wait (until ``deadline``, a ``time.monotonic()`` value) for the background loops to end."""
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    # -- background ----------------------------------------------------------------------
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

    def _orphan_loop(self) -> None:
        wait = 0.0
        while not self._stop.wait(wait):
            try:
                self.settle_orphans()
            except Exception as exc:  # noqa: BLE001 - retried at the next scan
                logger.warning("pool %r: the orphan scan failed: %s", self._prefix, exc)
            wait = self._scan_every_s * random.uniform(0.8, 1.2)
