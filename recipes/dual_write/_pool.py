"""A pool of dual writers over a bounded set of leased transactional ids (no hand-made ids).

Instances that share a database draw their transactional ids from one set
recorded in it (:mod:`._lease`).  Each instance holds a few of them, one per
concurrent transaction (a *slot*: a :class:`DualWriter` with its own
producer), renews its leases in the background, and settles the ids of
instances that stopped renewing (*orphans*).  Taking an id over is always the
writer's claim-before-Kafka recovery, so the lease only decides who recovers
and when; safety comes from the state row and Kafka's fencing, as with fixed ids.

Its parts, one idea each: the lease table (:mod:`._lease`), lease keeping
and the slots (:mod:`._slots`), the orphan scan (:mod:`._orphans`) and the
pipelined commit (:mod:`._pipeline`).
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
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kafka2pc import DEFAULT_CLOSE_TIMEOUT_S, IllegalStateError, UsageError
from kafka2pc._deprecation import seconds_from_ms

from ._handle import DualWriteTransaction
from ._lease import Lease, LeaseBook
from ._lease import define_lease_table as _make_lease_table
from ._orphans import OrphanSettling, _Admins
from ._pipeline import CommitPipeline, InFlightCommit
from ._schema import create_state_table
from ._schema import define_state_table as _make_state_table
from ._slots import PoolExhaustedError, _Counters, _Slot
from ._values import DualWriteMetrics, RecoveryResult, StepHook

if TYPE_CHECKING:
    from typing_extensions import Self

    from ._bind import Bind

__all__ = ["PoolExhaustedError", "PoolMetrics", "WriterPool"]

logger = logging.getLogger(__name__)


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



def _default_owner() -> str:
    return f"{socket.gethostname()[:120]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


class WriterPool(OrphanSettling):
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
    (default ``lease_s / 3``; each wait is drawn between 0.8 and 1.2 times
    it) the pool looks for leases that expired (their owner died or was cut
    off) and settles them, ``settle_parallelism`` at a time: claim the lease
    (its fencing epoch goes up), then the writer's recovery (claim the state
    row, fence the old producer, commit or abort the transaction it left,
    per the state the database stored).  So a killed instance holds back
    ``read_committed`` consumers for at most about ``lease_s + 1.2 *
    scan_every_s`` plus the recovery.  The pool's shuffles and jitter come
    from a generator of its own: an application that seeds the module
    ``random`` keeps its stream.

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
        self._step_observers = []
        self._book = LeaseBook(engine, self._lease_table, prefix, self._owner, self._lease_s)
        self._cond = self._new_condition()
        self._slots: list[_Slot] = []
        self._acquiring = 0
        self._counters = _Counters()
        self._renewed_at = time.monotonic()
        self._random = random.Random()  # seeded from os.urandom
        self._stop = self._new_event()
        self._threads: list[threading.Thread] = []
        self._started = False
        self._closed = False
        self._pipeline = self._new_pipeline(
            max_in_flight if max_in_flight is not None else max_slots, slow_commit_s
        ) if pipelined else None
        if start:
            self.start()

    # -- introspection ---------------------------------------------------------------
    @property
    def engine(self) -> sa.Engine:
        """The database holding the lease and state tables."""
        return self._engine

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

    def close(self, timeout: float | None = None) -> None:
        """Drain the pipelined commits, then give the leases back.

        A lease whose writer has nothing open is released (any instance may
        take it at once); one whose transaction is still open or in doubt is
        left to expire, so that an orphan scan recovers it.  Waits up to
        ``timeout`` seconds (``None``: :data:`~kafka2pc.DEFAULT_CLOSE_TIMEOUT_S`)
        for transactions running in other threads and for pipelined commits.
        """
        if timeout is None:
            timeout = DEFAULT_CLOSE_TIMEOUT_S
        elif timeout < 0:
            raise UsageError(f"close(timeout={timeout}): a timeout is in seconds and not negative")
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
        self._random.shuffle(leases)  # instances scanning at once start on different ids
        admins = self._new_admins()
        try:
            found = self._settle_each(leases, admins)
        finally:
            admins.close()
        return [r for r in found if r is not None]

    # -- what the asyncio pool (recipes/dual_write/aio) answers differently ---------------
    def _new_pipeline(self, max_in_flight: int, slow_commit_s: float) -> CommitPipeline:
        """The pipelined commit's runner (worker threads)."""
        return CommitPipeline(max_in_flight, slow_commit_s)

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
