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
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy as sa

from kafka2pc import DEFAULT_CLOSE_TIMEOUT_S, IllegalStateError, UsageError
from kafka2pc._deprecation import seconds_from_ms

from ._events import EVENTS, Listeners, StepListener
from ._handle import DualWriteTransaction
from ._lease import Lease, LeaseBook
from ._lease import define_lease_table as _make_lease_table
from ._lifecycle import PoolState
from ._options import (
    DEFAULT_ACQUIRE_TIMEOUT_S,
    DEFAULT_LEASE_S,
    DEFAULT_MAX_SLOTS,
    DEFAULT_SETTLE_PARALLELISM,
    DEFAULT_SLOW_COMMIT_S,
    MAX_POOL_LOCK_TIMEOUT_S,
    WriterOptions,
    options_from,
    pool_option_problems,
    raise_first,
)
from ._orphans import OrphanScanner
from ._pipeline import CommitPipeline, InFlightCommit
from ._runtime import THREADS, fork_lock, forks_seen, keep_inherited
from ._schema import create_state_table
from ._schema import define_state_table as _make_state_table
from ._slots import PoolExhaustedError, SlotKeeper
from ._values import DualWriteMetrics, RecoveryResult, StepHook
from ._writer import DualWriter, writer_on

if TYPE_CHECKING:
    from typing_extensions import Self

    from ._bind import Bind
    from ._runner import TransactionRunner
    from ._runtime import Background, Runtime

__all__ = ["PoolExhaustedError", "PoolMetrics", "PoolShape", "PoolState", "WriterPool", "pool_on"]

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
    return f"{socket.gethostname()[:120]}:{_child_suffix()}"


def _child_suffix() -> str:
    """``<pid>:<random>``: drawn anew in each process, so two children of one parent never share an owner."""
    return f"{os.getpid()}:{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class PoolShape:
    """A pool's own arguments (the writers' are a :class:`WriterOptions`), as given (checked by ``_setup``)."""

    prefix: str
    size: int
    max_slots: int | None = None
    lease_s: float = DEFAULT_LEASE_S
    scan_every_s: float | None = None
    acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S
    settle_parallelism: int = DEFAULT_SETTLE_PARALLELISM
    pipelined: bool = False
    max_in_flight: int | None = None
    slow_commit_s: float = DEFAULT_SLOW_COMMIT_S
    owner: str | None = None

    def keywords(self) -> dict[str, Any]:
        """The checked arguments by name (for :func:`pool_option_problems`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("prefix", "size")}


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
        lease_s: float = DEFAULT_LEASE_S,
        scan_every_s: float | None = None,
        acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S,
        settle_parallelism: int = DEFAULT_SETTLE_PARALLELISM,
        pipelined: bool = False,
        max_in_flight: int | None = None,
        slow_commit_s: float = DEFAULT_SLOW_COMMIT_S,
        state_table: sa.Table | None = None,
        lease_table: sa.Table | None = None,
        owner: str | None = None,
        retain_records: bool = False,
        lock_timeout_s: float | None = None,
        kafka_timeout_s: float | None = None,
        on_step: StepHook | None = None,
        start: bool = True,
        lock_timeout_ms: int | None = None,
        options: WriterOptions | None = None,
    ) -> None:
        """As the class documents; ``lock_timeout_ms`` is the deprecated spelling of ``lock_timeout_s``;
        ``options`` gives the writers' settings as one value (instead of their keywords)."""
        lock_timeout_s = seconds_from_ms(type(self).__name__, "lock_timeout_ms", lock_timeout_ms,
                                         "lock_timeout_s", lock_timeout_s)
        options = options_from(options, retain_records=retain_records, lock_timeout_s=lock_timeout_s,
                               kafka_timeout_s=kafka_timeout_s, on_step=on_step)
        self._setup(THREADS, engine, producer_config, PoolShape(
            prefix, size, max_slots, lease_s, scan_every_s, acquire_timeout_s, settle_parallelism, pipelined,
            max_in_flight, slow_commit_s, owner), options, state_table, lease_table)
        if start:
            self.start()

    def _setup(
        self, runtime: Runtime, engine: sa.Engine, producer_config: Mapping[str, Any], shape: PoolShape,
        options: WriterOptions, state_table: sa.Table | None, lease_table: sa.Table | None,
    ) -> None:
        if "transactional.id" in producer_config:
            raise UsageError("a WriterPool leases its transactional ids: remove 'transactional.id' from the config")
        prefix, size = shape.prefix, shape.size
        if not isinstance(prefix, str) or not prefix or (
                isinstance(size, int) and len(prefix) + 1 + len(str(max(size, 1) - 1)) > 255):
            raise UsageError("prefix must be a non-empty string; '<prefix>-<n>' must fit VARCHAR(255)")
        raise_first(pool_option_problems(size, shape.keywords()))
        self._runtime = runtime
        self._engine = engine
        self._config = dict(producer_config)
        self._shape = shape
        self._lease_s = float(shape.lease_s)
        self._max_slots = shape.max_slots if shape.max_slots is not None else min(size, DEFAULT_MAX_SLOTS)
        if options.lock_timeout_s is None:  # a recovery never waits on a paused instance's row lock longer
            options = dataclasses.replace(options, lock_timeout_s=min(self._lease_s, MAX_POOL_LOCK_TIMEOUT_S))
        self._options = options
        self._listeners = Listeners()
        """The pool's own listeners, fired by every writer of the pool before the writer's own."""
        metadata = sa.MetaData()
        self._state_table = state_table if state_table is not None else _make_state_table(metadata)
        self._lease_table = lease_table if lease_table is not None else _make_lease_table(metadata)
        self._given_owner = shape.owner
        self._random = random.Random()  # seeded from os.urandom: the application's stream is not drawn from
        self._build(shape.owner or _default_owner())

    def _build(self, owner: str) -> None:
        """Make what a process owns alone: the lease book under ``owner``, the slots, the orphan scan, the
        pipelined commit, the stop signal and the state (again in a forked child, see :meth:`_check_process`)."""
        shape = self._shape
        self._owner = owner
        self._forks = forks_seen()
        self._state = PoolState.NEW
        self._state_changed = self._runtime.condition()
        book = LeaseBook(self._engine, self._lease_table, shape.prefix, owner, self._lease_s)
        self._keeper = SlotKeeper(
            book, self._runtime, self._new_writer, prefix=shape.prefix, size=shape.size, max_slots=self._max_slots,
            lease_s=self._lease_s, acquire_timeout_s=shape.acquire_timeout_s,
            rng=self._random,
        )
        self._scanner = OrphanScanner(
            self._keeper, self._runtime, self._engine, self._state_table, self._config, self._options,
            prefix=shape.prefix, settle_parallelism=shape.settle_parallelism,
            scan_every_s=float(shape.scan_every_s) if shape.scan_every_s is not None else self._lease_s / 3,
            rng=self._random,
        )
        self._stop = self._runtime.event()
        self._background: Background | None = None
        self._pipeline = CommitPipeline(
            self._runtime, shape.max_in_flight if shape.max_in_flight is not None else self._max_slots,
            shape.slow_commit_s,
        ) if shape.pipelined else None

    def _new_writer(self, tid: str) -> tuple[DualWriter, TransactionRunner]:
        return writer_on(self._runtime, self._engine, {**self._config, "transactional.id": tid}, self._options,
                         state_table=self._state_table,
                         listeners=Listeners(self._options.on_step, parent=self._listeners))

    def _check_process(self) -> None:
        """In a forked child, on first use: remake what does not cross a fork (see the class docstring)."""
        if self._forks == forks_seen():
            return
        with fork_lock():
            if self._forks == forks_seen():
                return
            parent, was = self._owner, self._state
            keep_inherited(self._keeper, self._scanner, self._pipeline, self._background, self._stop)
            self._random.seed()  # from os.urandom: two children do not draw the parent's next shuffles alike
            # SQLAlchemy's documented step for an engine inherited through fork(): forget the parent's pooled
            # connections without closing them (the parent still uses them).
            self._engine.dispose(close=False)
            self._build(f"{self._given_owner[:200]}/{_child_suffix()}" if self._given_owner else _default_owner())
            if was is PoolState.CLOSED:
                self._state = PoolState.CLOSED
            logger.warning("pool %r: used in a forked child (pid %d) of its maker: its slots, producers and "
                           "background work stay the parent's; this process leases under owner %r (was %r)",
                           self._shape.prefix, os.getpid(), self._owner, parent)
            restart = was in (PoolState.STARTING, PoolState.RUNNING)
        if restart:
            self.start()

    # -- introspection ---------------------------------------------------------------
    @property
    def engine(self) -> sa.Engine:
        """The database holding the lease and state tables."""
        return self._engine

    @property
    def prefix(self) -> str:
        """The pool's name: its ids are ``<prefix>-0`` .. ``<prefix>-<size-1>``."""
        return self._shape.prefix

    @property
    def owner(self) -> str:
        """This instance's name in the lease table (host, pid and a random part)."""
        return self._owner

    @property
    def state(self) -> PoolState:
        """Where the pool is in its life cycle: new, starting, running or closed."""
        return self._state

    @property
    def options(self) -> WriterOptions:
        """How the pool's writers run (``lock_timeout_s`` filled in with the pool's default)."""
        return self._options

    @property
    def transactional_ids(self) -> list[str]:
        """Every id of the pool (all instances)."""
        return self._keeper.book.ids(self._shape.size)

    @property
    def held_ids(self) -> list[str]:
        """The ids this instance holds now (its slots)."""
        return self._keeper.held_ids()

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
        return self._keeper.book.read()

    def create_tables(self) -> None:
        """Create the state and lease tables if missing: a convenience for scripts and tests."""
        create_state_table(self._engine, self._state_table)
        self._lease_table.create(self._engine, checkfirst=True)

    def metrics(self) -> PoolMetrics:
        """A snapshot of the pool (no I/O; safe from any thread)."""
        keeper, scanner = self._keeper, self._scanner
        with keeper.cond:
            slots = list(keeper.slots)
            retired = list(keeper.retired)
        pipeline = self._pipeline
        writers = DualWriteMetrics.aggregate([s.writer.metrics() for s in slots] + retired)
        return PoolMetrics(
            transactions=dataclasses.replace(
                writers, heuristic_outcomes=writers.heuristic_outcomes + scanner.heuristics
            ),
            leases_held=sum(not s.lost for s in slots),
            slots_busy=sum(s.busy for s in slots),
            orphans_settled=keeper.orphans_taken + scanner.orphans_settled,
            orphan_recovery_errors=scanner.orphan_errors,
            leases_lost=keeper.leases_lost,
            commits_in_flight=pipeline.in_flight if pipeline else 0,
            oldest_commit_in_flight_age_s=pipeline.oldest_age_s() if pipeline else None,
            slow_commits=pipeline.slow_commits if pipeline else 0,
        )

    # -- events ----------------------------------------------------------------------
    events: ClassVar[frozenset[str]] = EVENTS
    """The events listeners may attach to (see :meth:`add_listener`)."""

    def add_listener(self, event: str, fn: StepListener) -> None:
        """Call ``fn(writer, step)`` at every :class:`Step` any writer of this pool reaches (``event="step"``).

        ``writer`` is the slot's :class:`DualWriter`.  As
        :meth:`DualWriter.add_listener`; the pool's listeners run before
        ``on_step``, in the thread (or task) running the step.

        Example::

            pool.add_listener("step", lambda writer, step: print(writer.transactional_id, step.value))
        """
        self._listeners.add(event, fn)

    def remove_listener(self, event: str, fn: StepListener) -> None:
        """Detach a listener :meth:`add_listener` attached (:class:`~kafka2pc.UsageError` if it was not)."""
        self._listeners.remove(event, fn)

    # -- life cycle ------------------------------------------------------------------
    def start(self) -> None:
        """Record the pool's ids (the missing ones), then start renewing leases and settling orphans.

        Called by the constructor unless ``start=False``.  The first orphan
        scan runs at once, in the background.  One-shot: callers racing to
        start the pool wait for the one that starts it (one set of background
        threads), and a start that failed may be tried again.  A no-op once
        the pool is closed.
        """
        self._check_process()
        with self._state_changed:
            while self._state is PoolState.STARTING:
                self._state_changed.wait()
            if self._state is not PoolState.NEW:
                return
            self._state = PoolState.STARTING
        try:
            self._keeper.book.ensure(self._shape.size)
            with self._state_changed:
                if self._state is PoolState.STARTING:
                    self._state = PoolState.RUNNING
                    self._keeper.renewed_now()
                    keeper, scanner, stop, prefix = self._keeper, self._scanner, self._stop, self._shape.prefix
                    self._background = self._runtime.background([
                        (f"k2pc-pool-renew-{prefix}", lambda: keeper.renew_loop(stop)),
                        (f"k2pc-pool-orphans-{prefix}", lambda: scanner.scan_loop(stop)),
                    ])
        finally:
            with self._state_changed:
                if self._state is PoolState.STARTING:  # ensure() failed: the next call tries again
                    self._state = PoolState.NEW
                self._state_changed.notify_all()

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
        self._check_process()
        with self._state_changed:
            if self._state is PoolState.CLOSED:
                return
            self._state = PoolState.CLOSED
            self._state_changed.notify_all()
        self._stop.set()
        if self._pipeline is not None:
            self._pipeline.drain(timeout)
        deadline = time.monotonic() + timeout
        slots = self._keeper.close(deadline)
        if self._background is not None:
            self._background.join(deadline)
        if self._pipeline is not None:
            self._pipeline.close()
        self._keeper.retire(slots)

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
        self._check_process()
        if self._state is PoolState.CLOSED:
            raise IllegalStateError(f"pool {self._shape.prefix!r} is closed")
        acquire_timeout_s = self._shape.acquire_timeout_s
        ready_by = time.monotonic() + acquire_timeout_s if acquire_timeout_s > 0 else None
        keeper = self._keeper
        slot = keeper.take(ready_by)
        handed_off: InFlightCommit | None = None
        try:
            if self._pipeline is None:
                with slot.runner.transaction(bind, None, ready_by=ready_by) as tx:
                    yield tx
            else:
                pipeline = self._pipeline

                def defer(commit: Callable[[], None]) -> None:
                    nonlocal handed_off
                    handed_off = pipeline.submit(slot.tid, commit, lambda: keeper.give_back(slot))

                with slot.runner.transaction(bind, defer, ready_by=ready_by) as tx:
                    yield tx
        finally:
            if handed_off is None:
                keeper.give_back(slot)
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
        self._check_process()
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
        self._check_process()
        return self._scanner.settle_orphans()


def pool_on(
    runtime: Runtime, engine: sa.Engine, producer_config: Mapping[str, Any], shape: PoolShape,
    options: WriterOptions, *, state_table: sa.Table | None = None, lease_table: sa.Table | None = None,
) -> WriterPool:
    """A :class:`WriterPool` that waits through ``runtime``, not started (how the asyncio twin makes its own)."""
    pool = WriterPool.__new__(WriterPool)
    pool._setup(runtime, engine, producer_config, shape, options, state_table, lease_table)
    return pool
