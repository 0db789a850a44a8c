"""KIP-939's dual-write recipe on SQLAlchemy 2.x: one database transaction, one Kafka transaction, one outcome.

The application writes rows and produces records inside one block; the
recipe makes both land or neither::

    import sqlalchemy as sa
    from kafka2pc.recipes.dual_write import DualWriter, state_table

    metadata = sa.MetaData()
    state_table(metadata)                       # kafka_transaction_state
    metadata.create_all(engine)

    writer = DualWriter(engine, {"bootstrap.servers": "localhost:9092",
                                 "transactional.id": "orders-1"})
    writer.recover()                            # at start-up, before new work
    with Session(engine) as session:
        with writer.transaction(session) as tx:
            session.add(Order(id=42))
            tx.produce("orders", key=b"42", value=b"created")

Normal path (the KIP's "normal processing recipe", in this order):

1. begin the database transaction.  SQLite (no row locks): an ``INSERT .. ON
   CONFLICT DO UPDATE`` of this transactional id's state row takes the
   database write lock, so a second instance with the same id blocks here,
   before it produces anything.  PostgreSQL: nothing is locked yet in steady
   state (optimistic; step 5 checks), only the first transaction after a
   recovery or a failure locks the row with an ``UPDATE .. RETURNING``;
2. begin the Kafka transaction;
3. the application produces records and writes rows;
4. prepare the Kafka transaction (flush; returns the :class:`PreparedTxnState`);
5. store the prepared state in the state row (and, with ``retain_records``,
   the records in an outbox table).  On PostgreSQL the update is guarded: it
   fails unless the row is still the version this writer wrote last (its
   ``xmin``), so a writer another instance took over rolls back here instead
   of committing a transaction Kafka no longer holds;
6. commit the database transaction: **the decision point** (on PostgreSQL
   with a Connection, sent together with step 5 in one round trip);
7. commit the Kafka transaction.

An exception before step 6 rolls back the database and aborts Kafka.  When the
outcome of step 6 is unknown (the connection died during COMMIT) or step 7
fails, the recipe does not guess: it reads the stored state back from the
database (waiting on the row lock, so an unfinished commit finishes first) and
lets ``complete_transaction`` commit the Kafka transaction if and only if the
database holds its state.

Recovery (the KIP's "recovery recipe", :meth:`DualWriter.recover`): lock the
state row, read the stored state, ``init_transactions(keep_prepared_txn=True)``
and ``complete_transaction(stored_state)`` with a fresh producer (which fences
any older instance), then accept new work.  If Kafka had already aborted the
transaction the database committed (the owner was down longer than
``transaction.timeout.ms``: librdkafka cannot open timeout-free 2PC
transactions), that *heuristic outcome* is raised as
:class:`~kafka2pc.HeuristicOutcomeError`, or, with ``retain_records=True``,
repaired: the records kept in the outbox table are re-published in a new
two-phase transaction, so even that case delivers them exactly once.

See ``docs/dual-write.md`` for the failure analysis and the metrics.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Final

from kafka2pc._extras import missing_extra

try:
    import sqlalchemy as sa
    from sqlalchemy.orm import Session
except ImportError as exc:
    raise missing_extra(exc, extra="sql", feature="kafka2pc.recipes.dual_write") from exc

from kafka2pc import (
    HeuristicOutcomeError,
    IllegalStateError,
    IndefiniteOutcomeError,
    Kafka2pcError,
    PreparedTxnState,
    ProducerFencedError,
    TxnState,
    UsageError,
)

if TYPE_CHECKING:
    from sqlalchemy.sql.dml import ReturningInsert
    from typing_extensions import Self

    from kafka2pc import Settlement, TwoPhaseCommitProducer

__all__ = [
    "DEFAULT_OUTBOX_TABLE",
    "DEFAULT_STATE_TABLE",
    "DualWriteMetrics",
    "DualWriteTransaction",
    "DualWriter",
    "RecoveryResult",
    "Step",
    "outbox_table",
    "recover_all",
    "state_table",
]

logger = logging.getLogger(__name__)

DEFAULT_STATE_TABLE: Final = "kafka_transaction_state"
DEFAULT_OUTBOX_TABLE: Final = "kafka_transaction_outbox"
_SETTLE_LOCK_TIMEOUT_MS: Final = 30_000
# PostgreSQL's system column naming the transaction that wrote a row version: the
# state row's optimistic concurrency token (compared as text, 32-bit xid: a false
# match needs 2**32 transactions between a writer's two commits *and* a hit).
_XMIN: Final[sa.ColumnClause[str]] = sa.literal_column("CAST(xmin AS text)")
_ROW_CHANGED: Final = "kafka2pc: the state row changed (another writer took over the transactional id)"

Bind = Session | sa.Connection
"""What :meth:`DualWriter.transaction` runs on: an ORM Session or a Core Connection."""


# -- schema ------------------------------------------------------------------------


def state_table(metadata: sa.MetaData, name: str = DEFAULT_STATE_TABLE, *, schema: str | None = None) -> sa.Table:
    """The ``transactional_id -> prepared_txn_state`` table of the KIP's "database schema prerequisite".

    Defined with SQLAlchemy Core on the caller's ``metadata`` so that
    ``metadata.create_all`` and Alembic autogenerate see it like any other
    table.  One row per transactional id; ``updated_at`` (UTC) is when a
    transaction or a recovery last locked the row.  Calling it again with the
    same name returns the table already defined.
    """
    key = name if schema is None else f"{schema}.{name}"
    existing = metadata.tables.get(key)
    if existing is not None:
        return existing
    return sa.Table(
        name,
        metadata,
        sa.Column("transactional_id", sa.String(255), primary_key=True),
        sa.Column("prepared_txn_state", sa.String(255), nullable=True),
        sa.Column("updated_at", sa.TIMESTAMP(), nullable=True),
        schema=schema,
    )


def outbox_table(metadata: sa.MetaData, name: str = DEFAULT_OUTBOX_TABLE, *, schema: str | None = None) -> sa.Table:
    """The table where ``retain_records=True`` keeps a transaction's records until Kafka commits it.

    Each row belongs to the transaction named by ``prepared_txn_state``; only
    rows of the state stored in :func:`state_table` are ever re-published.
    ``kafka_partition`` is the partition the record was delivered to, so a
    re-published record lands where the original would have.
    """
    key = name if schema is None else f"{schema}.{name}"
    existing = metadata.tables.get(key)
    if existing is not None:
        return existing
    return sa.Table(
        name,
        metadata,
        sa.Column("transactional_id", sa.String(255), primary_key=True),
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("prepared_txn_state", sa.String(255), nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("kafka_partition", sa.Integer(), nullable=True),
        sa.Column("record_key", sa.LargeBinary(), nullable=True),
        sa.Column("record_value", sa.LargeBinary(), nullable=True),
        sa.Column("headers", sa.Text(), nullable=True),
        schema=schema,
    )


_make_state_table = state_table  # the names are shadowed by DualWriter's keyword arguments
_make_outbox_table = outbox_table


# -- value types -------------------------------------------------------------------


class Step(str, enum.Enum):
    """The named points of the normal and recovery paths, in the order they happen.

    ``on_step`` (a testing and tracing aid) is called with each one; crash
    tests kill the process there.  The re-publication of retained records
    during recovery passes through the normal-path steps again.
    """

    DB_BEGUN = "db_begun"
    """Database transaction open; the state row locked and read, except on PostgreSQL in steady state."""
    KAFKA_BEGUN = "kafka_begun"
    PRODUCED = "produced"
    """After each :meth:`DualWriteTransaction.produce`."""
    BODY_DONE = "body_done"
    """The application's block finished (a Session is flushed): its rows are written."""
    PREPARED = "prepared"
    STATE_STORED = "state_stored"
    """The prepared state (and retained records) are written; the database has not committed.

    On PostgreSQL with a Connection the state update travels with the COMMIT:
    then this step and :attr:`DB_COMMITTING` both come right before that one
    round trip (the database has not committed either way)."""
    DB_COMMITTING = "db_committing"
    """Right before COMMIT is sent to the database."""
    DB_COMMITTED = "db_committed"
    KAFKA_COMMITTED = "kafka_committed"
    RECOVERY_LOCKED = "recovery_locked"
    """Recovery locked the state row and read the stored state."""
    RECOVERY_SETTLED = "recovery_settled"
    """Recovery settled the Kafka transaction; its database transaction is still open."""


StepHook = Callable[[Step], None]


@dataclass(frozen=True)
class RecoveryResult:
    """What :meth:`DualWriter.recover` found and did for one transactional id.

    ``settlement`` is the core's :class:`~kafka2pc.Settlement` (decision and
    final outcome of the stored transaction); ``republished`` counts records
    re-published from the outbox after a heuristic abort; ``error`` is set only
    by :func:`recover_all`, which reports failures instead of raising them.
    """

    transactional_id: str
    stored_state: PreparedTxnState
    settlement: Settlement | None
    republished: int = 0
    error: BaseException | None = None

    @property
    def heuristic(self) -> bool:
        """True when Kafka had aborted the transaction the database committed."""
        return self.settlement is not None and self.settlement.heuristic


@dataclass(frozen=True)
class DualWriteMetrics:
    """A point-in-time snapshot of one writer (or, via :meth:`aggregate`, of many).

    The two numbers to alert on:

    * ``oldest_open_transaction_age_s`` — seconds since the oldest transaction
      that is open (begun, prepared or in doubt) started; ``None`` when none is.
      A prepared transaction holds back ``read_committed`` consumers of every
      partition it wrote, and librdkafka's transactions are aborted by the
      broker after ``transaction.timeout.ms``: alert well before that.
    * ``in_doubt_transactions`` — prepared transactions whose outcome the
      writer could not settle yet (database unreachable after an unknown
      COMMIT outcome, or the Kafka commit failed); each needs a recovery.

    The rest are monotonic counters since the writer was created.
    """

    writers: int
    oldest_open_transaction_age_s: float | None
    in_doubt_transactions: int
    transactions_committed: int
    transactions_rolled_back: int
    recoveries: int
    heuristic_outcomes: int
    records_republished: int

    @classmethod
    def aggregate(cls, snapshots: Iterable[DualWriteMetrics]) -> DualWriteMetrics:
        """Combine per-writer snapshots (e.g. one writer per shard): sums, and the oldest age."""
        items = list(snapshots)
        ages = [s.oldest_open_transaction_age_s for s in items if s.oldest_open_transaction_age_s is not None]
        return cls(
            writers=sum(s.writers for s in items),
            oldest_open_transaction_age_s=max(ages) if ages else None,
            in_doubt_transactions=sum(s.in_doubt_transactions for s in items),
            transactions_committed=sum(s.transactions_committed for s in items),
            transactions_rolled_back=sum(s.transactions_rolled_back for s in items),
            recoveries=sum(s.recoveries for s in items),
            heuristic_outcomes=sum(s.heuristic_outcomes for s in items),
            records_republished=sum(s.records_republished for s in items),
        )


@dataclass
class _Record:
    topic: str
    key: bytes | None
    value: bytes | None
    partition: int | None
    headers: list[tuple[str, bytes | None]] | None


@dataclass
class _Bound:
    """A Session or Connection seen through the four operations the recipe needs."""

    connection: sa.Connection
    flush: Callable[[], None]
    commit: Callable[[], None]
    rollback: Callable[[], None]
    session: bool
    """True for a Session: its ``commit()`` may run hooks that write, so it must send the COMMIT itself."""


def _bind(bind: Bind) -> _Bound:
    if isinstance(bind, Session):
        return _Bound(bind.connection(), bind.flush, bind.commit, bind.rollback, True)
    if isinstance(bind, sa.Connection):
        if not bind.in_transaction():
            bind.begin()
        return _Bound(bind, lambda: None, bind.commit, bind.rollback, False)
    raise UsageError(f"transaction() takes a SQLAlchemy Session or Connection, not {type(bind).__name__}")


def _utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def _as_bytes(data: str | bytes | None) -> bytes | None:
    if data is None or isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return data.encode()
    raise UsageError(f"keys and values are bytes or str, not {type(data).__name__}")


def _encode_headers(headers: list[tuple[str, bytes | None]] | None) -> str | None:
    if headers is None:
        return None
    return json.dumps([[k, None if v is None else v.hex()] for k, v in headers])


def _decode_headers(text: str | None) -> list[tuple[str, bytes | None]] | None:
    if text is None:
        return None
    return [(k, None if v is None else bytes.fromhex(v)) for k, v in json.loads(text)]


def _normalize_headers(headers: Any) -> list[tuple[str, bytes | None]] | None:
    if headers is None:
        return None
    items = headers.items() if isinstance(headers, Mapping) else headers
    return [(str(k), _as_bytes(v)) for k, v in items]


# -- the transaction handle ----------------------------------------------------------


class DualWriteTransaction:
    """The handle :meth:`DualWriter.transaction` yields: produce records, add consumer offsets.

    Rows are written with the Session or Connection the transaction was
    opened on (also available as :attr:`connection`); they commit together
    with the records produced here.
    """

    def __init__(self, writer: DualWriter, producer: TwoPhaseCommitProducer, connection: sa.Connection) -> None:
        self._writer = writer
        self._producer = producer
        self._connection = connection
        self._records: list[_Record] = []
        self._produced = 0
        self._prepared: PreparedTxnState | None = None

    @property
    def connection(self) -> sa.Connection:
        """The database connection of this transaction."""
        return self._connection

    @property
    def transactional_id(self) -> str:
        """The Kafka transactional id this transaction runs under."""
        return self._producer.transactional_id

    @property
    def prepared_state(self) -> PreparedTxnState | None:
        """The state stored in the database once the transaction is prepared."""
        return self._prepared

    @property
    def records_produced(self) -> int:
        """How many records this transaction produced so far."""
        return self._produced

    def produce(
        self,
        topic: str,
        value: str | bytes | None = None,
        key: str | bytes | None = None,
        *,
        partition: int | None = None,
        headers: Mapping[str, str | bytes | None] | Sequence[tuple[str, str | bytes | None]] | None = None,
        timestamp: int | None = None,
        on_delivery: Callable[[Any, Any], None] | None = None,
    ) -> None:
        """Produce one record in the transaction (arguments as ``confluent_kafka.Producer.produce``).

        A full local queue is waited out (serving delivery reports) for up to
        the writer's ``queue_full_timeout_s``.
        """
        record = _Record(topic, _as_bytes(key), _as_bytes(value), partition, _normalize_headers(headers))
        self._produced += 1
        kwargs: dict[str, Any] = {"value": record.value, "key": record.key}
        if self._writer.retain_records:
            self._records.append(record)  # copied to the outbox table after the prepare

            def delivered(err: Any, msg: Any) -> None:
                if err is None:
                    record.partition = msg.partition()  # re-published to the same partition
                if on_delivery is not None:
                    on_delivery(err, msg)

            kwargs["on_delivery"] = delivered
        elif on_delivery is not None:
            kwargs["on_delivery"] = on_delivery
        if partition is not None:
            kwargs["partition"] = partition
        if record.headers is not None:
            kwargs["headers"] = record.headers
        if timestamp is not None:
            kwargs["timestamp"] = timestamp
        self._writer._produce(self._producer, topic, kwargs)
        self._writer._step(Step.PRODUCED)

    def send_offsets_to_transaction(self, offsets: list[Any], group_metadata: Any) -> None:
        """Commit consumer offsets with this transaction (exactly-once consume-transform-produce).

        ``offsets`` are ``confluent_kafka.TopicPartition`` positions (the next
        offset to read), ``group_metadata`` is ``consumer.consumer_group_metadata()``.
        """
        self._producer.send_offsets_to_transaction(offsets, group_metadata)

    def send_consumer_offsets(self, consumer: Any) -> None:
        """Commit the current positions of ``consumer``'s assignment with this transaction."""
        positions = [tp for tp in consumer.position(consumer.assignment()) if tp.offset >= 0]
        if positions:
            self.send_offsets_to_transaction(positions, consumer.consumer_group_metadata())


# -- the writer -----------------------------------------------------------------------


class DualWriter:
    """Atomic writes to a SQL database and Kafka under one transactional id (KIP-939's dual-write recipe).

    ``engine`` is the database holding the state table (and the outbox table
    with ``retain_records=True``); the Sessions and Connections given to
    :meth:`transaction` must use that same database.  ``producer_config`` is a
    confluent-kafka producer configuration with ``transactional.id``: run one
    writer per instance (or per shard), each with its own id.

    ``retain_records=True`` also keeps each transaction's records in the
    outbox table until Kafka has committed them, so that a transaction Kafka
    aborted behind the database's back (heuristic outcome) is re-published by
    :meth:`recover` instead of lost.  ``lock_timeout_ms`` bounds the wait for
    the state row lock on PostgreSQL (SQLite's wait is the driver's busy
    timeout).  ``kafka_timeout_s`` bounds the prepare (flush), commit and
    abort calls (default: librdkafka's own limits, up to
    ``transaction.timeout.ms``); a prepare that times out rolls the
    transaction back, a commit that times out is settled through recovery.
    ``on_step`` is a testing and tracing aid, called at every
    :class:`Step`; an exception it raises before the database commit rolls
    the transaction back.

    Thread-safe: transactions of one writer run one at a time.
    """

    def __init__(
        self,
        engine: sa.Engine,
        producer_config: Mapping[str, Any],
        *,
        state_table: sa.Table | None = None,
        outbox_table: sa.Table | None = None,
        retain_records: bool = False,
        lock_timeout_ms: int | None = None,
        on_step: StepHook | None = None,
        settle_attempts: int = 5,
        queue_full_timeout_s: float = 60.0,
        kafka_timeout_s: float | None = None,
    ) -> None:
        tid = producer_config.get("transactional.id")
        if not isinstance(tid, str) or not tid:
            raise UsageError("producer_config must set 'transactional.id' to a non-empty string")
        if len(tid) > 255:
            raise UsageError("transactional.id must fit the state table's VARCHAR(255)")
        if settle_attempts < 1:
            raise UsageError("settle_attempts must be at least 1")
        self._engine = engine
        self._config = dict(producer_config)
        self._tid = tid
        metadata = sa.MetaData()
        self._state = state_table if state_table is not None else _make_state_table(metadata)
        if retain_records and outbox_table is None:
            outbox_table = _make_outbox_table(metadata)
        self._outbox = outbox_table
        self._retain = retain_records
        self._lock_timeout_ms = lock_timeout_ms
        self._on_step = on_step
        self._settle_attempts = settle_attempts
        self._queue_full_timeout_s = queue_full_timeout_s
        if kafka_timeout_s is not None and kafka_timeout_s <= 0:
            raise UsageError("kafka_timeout_s must be positive (or None to wait as librdkafka does)")
        self._kafka_timeout_s = kafka_timeout_s
        self._serial = threading.Lock()
        self._owner: int | None = None
        self._producer: TwoPhaseCommitProducer | None = None
        self._last_state: str | None = None
        # PostgreSQL: the state row's xmin as this writer last committed it, its
        # optimistic concurrency token (see _store_state).  None: unknown, so the
        # next transaction locks the row first.
        self._token: str | None = None
        self._fenced = False
        self._needs_recovery = False
        self._outbox_dirty = True
        self._open_since: float | None = None
        self._in_doubt: PreparedTxnState | None = None
        self._in_doubt_since: float | None = None
        self._committed = 0
        self._rolled_back = 0
        self._recoveries = 0
        self._heuristics = 0
        self._republished = 0

    # -- introspection -------------------------------------------------------------
    @property
    def transactional_id(self) -> str:
        """The Kafka transactional id (and the state row's key)."""
        return self._tid

    @property
    def state_table(self) -> sa.Table:
        """The state table this writer locks and updates."""
        return self._state

    @property
    def outbox_table(self) -> sa.Table | None:
        """The outbox table (``None`` unless configured or ``retain_records=True``)."""
        return self._outbox

    @property
    def retain_records(self) -> bool:
        """Whether records are kept in the outbox until Kafka commits them."""
        return self._retain

    @property
    def producer(self) -> TwoPhaseCommitProducer | None:
        """The current producer (``None`` before the first recovery)."""
        return self._producer

    @property
    def fenced(self) -> bool:
        """True once another instance took over this transactional id; only :meth:`recover` resets it."""
        return self._fenced

    def create_tables(self) -> None:
        """Create the state (and outbox) table if missing: a convenience for scripts and tests."""
        tables = [self._state] + ([self._outbox] if self._outbox is not None else [])
        for table in tables:
            table.create(self._engine, checkfirst=True)

    def metrics(self) -> DualWriteMetrics:
        """A snapshot of this writer's gauges and counters (no I/O; safe from any thread)."""
        now = time.monotonic()
        starts = [t for t in (self._open_since, self._in_doubt_since) if t is not None]
        return DualWriteMetrics(
            writers=1,
            oldest_open_transaction_age_s=(now - min(starts)) if starts else None,
            in_doubt_transactions=1 if self._in_doubt is not None else 0,
            transactions_committed=self._committed,
            transactions_rolled_back=self._rolled_back,
            recoveries=self._recoveries,
            heuristic_outcomes=self._heuristics,
            records_republished=self._republished,
        )

    # -- life cycle ------------------------------------------------------------------
    def recover(self, *, raise_on_heuristic: bool = True) -> RecoveryResult:
        """Settle whatever the previous owner of this transactional id left, then accept new work.

        Locks the state row (so no other instance's transaction interleaves),
        reads the stored :class:`PreparedTxnState` (the empty state if there is
        no row), and with a new producer runs
        ``init_transactions(keep_prepared_txn=True)`` and
        ``complete_transaction(stored)``: the open Kafka transaction is
        committed if the database committed its state, aborted otherwise.  The
        new producer fences every older instance.  Idempotent: recovering again
        finds nothing open.

        If Kafka had aborted the transaction the database committed (heuristic
        outcome): with ``retain_records=True`` its records are re-published
        in a new two-phase transaction and the result says how many; otherwise
        :class:`~kafka2pc.HeuristicOutcomeError` is raised (after logging the
        transactional id, the stored state and what to do), unless
        ``raise_on_heuristic=False``, in which case the result reports it.
        The writer is ready for new work either way.
        """
        with self._exclusive():
            return self._recover(raise_on_heuristic=raise_on_heuristic)

    @contextmanager
    def transaction(self, bind: Bind) -> Iterator[DualWriteTransaction]:
        """Run one atomic database + Kafka transaction on ``bind`` (a Session or a Connection).

        The database transaction is begun here (or the one ``bind`` already
        has is adopted) and committed on a normal exit of the block; an
        exception in the block rolls back both sides and propagates.  Runs
        :meth:`recover` first if it was never run or a previous failure left
        the outcome open.  Raises :class:`~kafka2pc.ProducerFencedError` when
        another instance took over the transactional id, and
        :class:`~kafka2pc.IndefiniteOutcomeError` when the database commit's
        outcome cannot be read back (the Kafka transaction then stays prepared
        until :meth:`recover`).
        """
        with self._exclusive():
            self._ensure_ready()
            producer = self._require_producer()
            bound = _bind(bind)
            conn = bound.connection
            tx = DualWriteTransaction(self, producer, conn)
            kafka_begun = False
            # The token is spent here; only a committed transaction hands out a new one.
            token, self._token = (self._token if conn.dialect.name == "postgresql" else None), None
            self._open_since = time.monotonic()
            try:
                if token is None:
                    stored, token = self._lock_state(conn)
                    if stored != self._last_state:
                        self._fenced = True
                        raise ProducerFencedError(
                            f"{self._tid!r}: the state row holds {stored!r}, not {self._last_state!r} which this "
                            "writer stored last: another instance wrote under the same transactional id; "
                            "this one stops (recover() takes over again)"
                        )
                if self._retain and self._outbox_dirty:
                    self._delete_outbox(bound.connection)
                self._step(Step.DB_BEGUN)
                producer.begin_transaction()
                kafka_begun = True
                self._step(Step.KAFKA_BEGUN)
                yield tx
                bound.flush()
                self._step(Step.BODY_DONE)
                state = producer.prepare_transaction(self._kafka_timeout_s)
                tx._prepared = state
                self._step(Step.PREPARED)
                if self._retain:
                    self._insert_outbox(conn, state, tx._records)
                # PostgreSQL over psycopg 3 with a Connection: the state update goes with the
                # COMMIT in one round trip (_store_state_and_commit); Steps as if they were two.
                combined = token is not None and not bound.session and conn.dialect.driver == "psycopg"
                if not combined:
                    token = self._store_state(conn, state, token)
                self._step(Step.STATE_STORED)
                self._step(Step.DB_COMMITTING)
            except BaseException as exc:
                self._open_since = None
                self._rollback_both(bound, producer if kafka_begun else None, exc)
                if self._fenced and isinstance(exc, Kafka2pcError) and not isinstance(exc, ProducerFencedError):
                    raise ProducerFencedError(
                        f"{self._tid!r}: another instance took over the transactional id ({exc}); "
                        "this transaction was rolled back on both sides"
                    ) from exc
                raise
            try:
                self._finish(bound, producer, state, token, combined)
            finally:
                self._open_since = None

    def close(self) -> None:
        """Release the producer.  A prepared transaction is left for the next :meth:`recover`."""
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.close()
            except Exception:  # a fenced producer's flush raises; there is nothing left to release
                logger.debug("%s: closing the producer failed", self._tid, exc_info=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- normal path internals ---------------------------------------------------------
    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        if self._owner == threading.get_ident():
            raise IllegalStateError(f"{self._tid!r}: transaction() and recover() cannot be nested")
        with self._serial:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def _step(self, step: Step) -> None:
        if self._on_step is not None:
            self._on_step(step)

    def _ensure_ready(self) -> None:
        if self._fenced:
            raise ProducerFencedError(
                f"{self._tid!r} was taken over by another instance; call recover() only if that one is gone"
            )
        producer = self._producer
        if producer is None or self._needs_recovery or producer.state is not TxnState.READY:
            self._recover(raise_on_heuristic=True)

    def _require_producer(self) -> TwoPhaseCommitProducer:
        if self._producer is None:
            raise IllegalStateError(f"{self._tid!r}: no producer; call recover() first")
        return self._producer

    def _produce(self, producer: TwoPhaseCommitProducer, topic: str, kwargs: dict[str, Any]) -> None:
        from kafka2pc import QueueFullError

        deadline = time.monotonic() + self._queue_full_timeout_s
        while True:
            try:
                producer.produce(topic, **kwargs)
                return
            except QueueFullError:
                if time.monotonic() > deadline:
                    raise
                producer.poll(0.05)

    def _lock_state(self, conn: sa.Connection) -> tuple[str | None, str | None]:
        """Lock this id's state row in ``conn``'s transaction; return the stored state and the row's token.

        PostgreSQL: an ``UPDATE .. RETURNING`` of ``updated_at``, which locks
        the row *and* gives it a new ``xmin``: every token another instance
        holds is void from then on (see :meth:`_store_state`).  The token
        returned is that ``xmin``.  Other row-locking databases:
        ``SELECT .. FOR UPDATE``, no token.  The row exists from the first
        recovery on; a missing one is upserted, which locks it as well
        (concurrent upserts of a new row serialize on its key).  SQLite has
        no row locks: the upsert's write takes the database's write lock,
        held until COMMIT.
        """
        table = self._state
        dialect = conn.dialect.name
        where = table.c.transactional_id == self._tid
        if dialect == "postgresql":
            if self._lock_timeout_ms is not None:
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = {int(self._lock_timeout_ms)}")
            touched = conn.execute(
                sa.update(table).where(where).values(updated_at=_utcnow()).returning(table.c.prepared_txn_state, _XMIN)
            ).first()
            if touched is None:
                self._upsert_state_row(conn)
                touched = conn.execute(sa.select(table.c.prepared_txn_state, _XMIN).where(where)).one()
            return touched[0], touched[1]
        if dialect != "sqlite":
            locked = conn.execute(
                sa.select(table.c.prepared_txn_state).where(table.c.transactional_id == self._tid).with_for_update()
            ).first()
            if locked is not None:
                stored: str | None = locked[0]
                return stored, None
        return self._upsert_state_row(conn), None

    def _upsert_state_row(self, conn: sa.Connection) -> str | None:
        """Insert the state row if missing, else touch ``updated_at``; return the stored state."""
        table = self._state
        dialect = conn.dialect.name
        row = {"transactional_id": self._tid, "prepared_txn_state": None, "updated_at": _utcnow()}
        upsert: ReturningInsert[Any] | None = None
        if dialect == "postgresql":
            from sqlalchemy.dialects import postgresql

            pg = postgresql.insert(table).values(**row)
            upsert = pg.on_conflict_do_update(
                index_elements=[table.c.transactional_id], set_={"updated_at": pg.excluded.updated_at}
            ).returning(table.c.prepared_txn_state)
        elif dialect == "sqlite":
            from sqlalchemy.dialects import sqlite

            lite = sqlite.insert(table).values(**row)
            upsert = lite.on_conflict_do_update(
                index_elements=[table.c.transactional_id], set_={"updated_at": lite.excluded.updated_at}
            ).returning(table.c.prepared_txn_state)
        if upsert is not None:
            value: str | None = conn.execute(upsert).scalar_one()
            return value
        # Any other dialect: UPDATE locks an existing row; INSERT a new one.
        where = table.c.transactional_id == self._tid
        if conn.execute(sa.update(table).where(where).values(updated_at=row["updated_at"])).rowcount == 0:
            conn.execute(sa.insert(table).values(**row))
            return None
        stored: str | None = conn.execute(sa.select(table.c.prepared_txn_state).where(where)).scalar_one()
        return stored

    def _store_state(self, conn: sa.Connection, state: PreparedTxnState, token: str | None) -> str | None:
        """Write ``state`` into the state row; with a PostgreSQL ``token``, only if the row is unchanged.

        The optimistic check (PostgreSQL): the row must still carry the
        ``xmin`` this writer saw when it last wrote or locked it, and the
        state it stored last.  Every other writer of the row (another
        instance's recovery or transaction, ``kafka2pc recover``) gives it a
        new ``xmin``, so a writer that was taken over finds out here, before
        its database commit, and rolls back.  Returns the row's new token.
        """
        table = self._state
        where = table.c.transactional_id == self._tid
        values = {"prepared_txn_state": str(state), "updated_at": _utcnow()}
        if token is None:
            if conn.execute(sa.update(table).where(where).values(**values)).rowcount != 1:
                raise IllegalStateError(f"{self._tid!r}: the locked state row disappeared")
            return None
        guarded = sa.and_(
            where,
            sa.text("xmin = CAST(:k2pc_token AS xid)").bindparams(k2pc_token=token),
            table.c.prepared_txn_state.is_not_distinct_from(self._last_state),
        )
        new_token: str | None = conn.execute(
            sa.update(table).where(guarded).values(**values).returning(_XMIN)
        ).scalar_one_or_none()
        if new_token is None:
            raise self._taken_over()
        return new_token

    def _store_state_and_commit(self, conn: sa.Connection, state: PreparedTxnState, token: str) -> str:
        """:meth:`_store_state`'s guarded update and ``COMMIT`` in one statement text, one round trip.

        Sent through SQLAlchemy (errors arrive as ``sqlalchemy.exc.DBAPIError``,
        a dead connection is invalidated) with ``no_parameters``, so psycopg
        uses the simple query protocol (values quoted by psycopg), which
        allows two statements: PostgreSQL runs them in order and skips the
        ``COMMIT`` if the update fails.  A changed row makes the update's
        result fail a cast, on purpose, naming the reason: the transaction then
        rolls back instead of committing without its state.  Returns the new token.
        """
        import psycopg
        from psycopg import sql

        driver = conn.connection.driver_connection
        if driver is None:
            raise IllegalStateError(f"{self._tid!r}: the database connection is closed")
        table = self._state
        name = sql.Identifier(table.schema, table.name) if table.schema else sql.Identifier(table.name)
        statement = sql.SQL(
            "WITH u AS (UPDATE {table} SET prepared_txn_state = {state}, updated_at = {now} "
            "WHERE transactional_id = {tid} AND xmin = {token}::xid "
            "AND prepared_txn_state IS NOT DISTINCT FROM {last}::text RETURNING xmin::text AS t) "
            "SELECT CAST(COALESCE((SELECT t FROM u), {changed}) AS bigint); COMMIT"
        ).format(
            table=name, state=sql.Literal(str(state)), now=sql.Literal(_utcnow()), tid=sql.Literal(self._tid),
            token=sql.Literal(token), last=sql.Literal(self._last_state), changed=sql.Literal(_ROW_CHANGED),
        )
        try:
            new_token = conn.exec_driver_sql(
                statement.as_string(driver), execution_options={"no_parameters": True}
            ).scalar_one()
        except sa.exc.DBAPIError as exc:
            if isinstance(exc.orig, psycopg.errors.InvalidTextRepresentation) and _ROW_CHANGED in str(exc.orig):
                raise self._taken_over() from exc
            raise
        return str(new_token)

    def _taken_over(self) -> ProducerFencedError:
        self._fenced = True
        return ProducerFencedError(
            f"{self._tid!r}: the state row changed since this writer last wrote it: another instance (or an "
            "operator's `kafka2pc recover`) took over the transactional id; this transaction is rolled back on "
            "both sides and this writer stops (recover() takes over again)"
        )

    def _read_state_settled(self) -> str | None:
        """Read the stored state in a new connection, after any unfinished transaction on the row ended.

        On PostgreSQL ``FOR UPDATE`` waits (bounded) for the row lock, so a
        COMMIT still running on a dying connection finishes before we read.
        """
        table = self._state
        with self._engine.connect() as conn, conn.begin():
            stmt = sa.select(table.c.prepared_txn_state).where(table.c.transactional_id == self._tid)
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = {_SETTLE_LOCK_TIMEOUT_MS}")
            if conn.dialect.name != "sqlite":
                stmt = stmt.with_for_update()
            value: str | None = conn.execute(stmt).scalar_one_or_none()
            return value

    def _insert_outbox(self, conn: sa.Connection, state: PreparedTxnState, records: list[_Record]) -> None:
        if self._outbox is None or not records:
            return
        conn.execute(
            sa.insert(self._outbox),
            [
                {
                    "transactional_id": self._tid,
                    "seq": i,
                    "prepared_txn_state": str(state),
                    "topic": r.topic,
                    "kafka_partition": r.partition,
                    "record_key": r.key,
                    "record_value": r.value,
                    "headers": _encode_headers(r.headers),
                }
                for i, r in enumerate(records)
            ],
        )

    def _delete_outbox(self, conn: sa.Connection) -> None:
        if self._outbox is not None:
            conn.execute(sa.delete(self._outbox).where(self._outbox.c.transactional_id == self._tid))
        self._outbox_dirty = False

    def _rollback_both(
        self, bound: _Bound, producer: TwoPhaseCommitProducer | None, cause: BaseException
    ) -> None:
        self._rolled_back += 1
        try:
            bound.rollback()
        except Exception:  # the server rolls back a dead connection's transaction by itself
            logger.warning("%s: database rollback failed", self._tid, exc_info=True)
        if isinstance(cause, ProducerFencedError):
            self._fenced = True
        if producer is None:
            return
        try:
            producer.abort_transaction(self._kafka_timeout_s)
        except Kafka2pcError as exc:
            # The database rolled back, so abort is the only right outcome; the next
            # recovery aborts whatever is still open (the stored state is not this one).
            if isinstance(exc, ProducerFencedError):
                self._fenced = True
            self._needs_recovery = True
            logger.warning("%s: abort after %r failed (%s); %s", self._tid, cause, exc,
                           "fenced: this writer stops" if self._fenced else "recovering before the next transaction")

    def _finish(
        self, bound: _Bound, producer: TwoPhaseCommitProducer, state: PreparedTxnState,
        token: str | None, combined: bool,
    ) -> None:
        try:
            if combined and token is not None:
                token = self._store_state_and_commit(bound.connection, state, token)
            bound.commit()  # after _store_state_and_commit: bookkeeping only, psycopg sends nothing
        except ProducerFencedError as exc:  # the guarded update failed: nothing committed
            self._rollback_both(bound, producer, exc)
            raise
        except BaseException as exc:
            if not self._settle_unknown_db_commit(bound, producer, state, exc):
                self._rolled_back += 1
                raise
            self._committed += 1
            return
        self._token = token
        self._last_state = str(state)
        self._outbox_dirty = self._retain
        self._step(Step.DB_COMMITTED)
        try:
            producer.commit_transaction(self._kafka_timeout_s)
        except Kafka2pcError as exc:
            self._after_kafka_commit_failure(producer, state, exc)
        self._committed += 1
        self._step(Step.KAFKA_COMMITTED)

    def _settle_unknown_db_commit(
        self, bound: _Bound, producer: TwoPhaseCommitProducer, state: PreparedTxnState, cause: BaseException
    ) -> bool:
        """COMMIT raised: read what the database decided and complete Kafka accordingly; True if committed."""
        try:
            bound.rollback()  # no-op if the commit went through; releases a still-open transaction
        except sa.exc.SQLAlchemyError:
            logger.debug("%s: rollback after the failed COMMIT failed too (dead connection)", self._tid)
        try:
            stored = self._read_state_settled()
        except sa.exc.SQLAlchemyError as read_exc:
            self._in_doubt, self._in_doubt_since = state, time.monotonic()
            self._needs_recovery = True
            logger.error(
                "%s: the database COMMIT failed (%r) and the stored state cannot be read (%r): Kafka "
                "transaction %s stays prepared until recover()", self._tid, cause, read_exc, state,
            )
            raise IndefiniteOutcomeError(
                f"{self._tid!r}: outcome of the database COMMIT unknown ({cause!r}) and the state row cannot be "
                f"read ({read_exc!r}); the Kafka transaction {state} stays prepared: call recover()",
                state=state,
            ) from cause
        committed = stored == str(state)
        logger.warning(
            "%s: the database COMMIT raised %r; the state row says it %s: %s the Kafka transaction",
            self._tid, cause, "committed" if committed else "rolled back", "committing" if committed else "aborting",
        )
        if committed:
            self._last_state = stored
            self._outbox_dirty = self._retain
        try:
            producer.complete_transaction(PreparedTxnState(stored) if stored else PreparedTxnState())
        except Kafka2pcError as exc:
            if committed:
                self._after_kafka_commit_failure(producer, state, exc)
            else:
                self._needs_recovery = True
                logger.warning("%s: abort after a rolled-back COMMIT failed (%s)", self._tid, exc)
        return committed

    def _after_kafka_commit_failure(
        self, producer: TwoPhaseCommitProducer, state: PreparedTxnState, cause: Kafka2pcError
    ) -> None:
        """The database committed ``state`` but Kafka's commit failed: settle, never guess."""
        self._in_doubt, self._in_doubt_since = state, time.monotonic()
        if isinstance(cause, ProducerFencedError):
            # Another instance recovered this id: it read our state from the database and
            # settled our transaction.  Only look (recovering would fence it in turn).
            from kafka2pc import TransactionOutcome
            from kafka2pc._recovery import outcome_of

            self._fenced = True
            outcome = outcome_of(producer.control_plane, state)
            if outcome is TransactionOutcome.COMMITTED:
                logger.warning("%s: fenced during commit; the new owner committed %s", self._tid, state)
                self._in_doubt = self._in_doubt_since = None
                return
            if outcome is TransactionOutcome.ABORTED:
                self._heuristics += 1
                raise HeuristicOutcomeError(
                    f"{self._tid!r}: the database committed {state} but Kafka aborted it, and another instance "
                    "owns the id now (its recover() re-publishes retained records)",
                    transactional_id=self._tid, state=state, outcome="aborted",
                ) from cause
            raise IndefiniteOutcomeError(
                f"{self._tid!r}: fenced while committing {state}; its outcome is {outcome.value}", state=state
            ) from cause
        logger.warning("%s: Kafka commit of %s failed (%s): settling through recovery", self._tid, state, cause)
        try:
            self._recover(raise_on_heuristic=True)
        except HeuristicOutcomeError:
            raise
        except Kafka2pcError as exc:
            raise IndefiniteOutcomeError(
                f"{self._tid!r}: the database committed {state} but the Kafka commit failed ({cause}) and could not "
                f"be settled yet ({exc}); recover() commits it later: do not redo the transaction",
                state=state,
            ) from exc

    # -- recovery internals --------------------------------------------------------------
    def _recover(self, *, raise_on_heuristic: bool) -> RecoveryResult:
        from kafka2pc import TwoPhaseCommitProducer

        old, self._producer = self._producer, None
        if old is not None:
            try:
                old.close()
            except Exception:  # the new producer fences it anyway
                logger.debug("%s: closing the old producer failed", self._tid, exc_info=True)
        self._recoveries += 1
        self._fenced = False
        heuristic_error: HeuristicOutcomeError | None = None
        republished = 0
        with self._engine.connect() as conn:
            conn.begin()
            try:
                self._token = None  # the first transaction after a recovery locks the row again
                stored, _ = self._lock_state(conn)
                state = PreparedTxnState(stored) if stored else PreparedTxnState()
                self._step(Step.RECOVERY_LOCKED)
                producer = TwoPhaseCommitProducer(self._config)
                try:
                    producer.init_transactions(keep_prepared_txn=True)
                    settlement, heuristic_error = self._complete(producer, state)
                except BaseException:
                    producer.close()
                    raise
                self._producer = producer
                self._step(Step.RECOVERY_SETTLED)
                new_stored = stored
                if heuristic_error is not None:
                    self._log_heuristic(conn, state)
                if heuristic_error is not None and self._retain:
                    republished, new_stored = self._republish(conn, producer, state)
                    if republished:
                        heuristic_error = None
                else:
                    if heuristic_error is None:
                        self._delete_outbox(conn)  # the stored transaction is settled: its copies are spent
                    conn.commit()
            except BaseException:
                self._needs_recovery = True
                try:
                    conn.rollback()
                except sa.exc.SQLAlchemyError:
                    logger.debug("%s: rollback of the recovery transaction failed", self._tid, exc_info=True)
                raise
        self._last_state = new_stored
        self._needs_recovery = False
        self._in_doubt = self._in_doubt_since = None
        result = RecoveryResult(self._tid, state, settlement, republished)
        logger.info(
            "%s: recovered (stored %s; %s -> %s%s)", self._tid, state, settlement.plan.decision.value,
            settlement.outcome.value, f"; re-published {republished} records" if republished else "",
        )
        if heuristic_error is not None and raise_on_heuristic:
            raise heuristic_error
        return result

    def _complete(
        self, producer: TwoPhaseCommitProducer, state: PreparedTxnState
    ) -> tuple[Settlement, HeuristicOutcomeError | None]:
        from kafka2pc import Settlement, TransactionOutcome
        from kafka2pc._recovery import plan

        for attempt in range(1, self._settle_attempts + 1):
            try:
                producer.complete_transaction(state)
            except HeuristicOutcomeError as exc:
                self._heuristics += 1
                return Settlement(plan(producer.control_plane, self._tid, state), TransactionOutcome.ABORTED), exc
            except IndefiniteOutcomeError:
                if attempt == self._settle_attempts:
                    raise
                logger.warning("%s: completing %s: outcome unknown, retrying (%d/%d)",
                               self._tid, state, attempt, self._settle_attempts)
                time.sleep(min(0.2 * 2**attempt, 5.0))
                continue
            settled = producer.last_settlement
            if settled is None:
                raise IllegalStateError(f"{self._tid!r}: complete_transaction() reported no settlement")
            return settled, None
        raise IllegalStateError("unreachable: the last attempt returns or raises")  # pragma: no cover

    def _log_heuristic(self, conn: sa.Connection, state: PreparedTxnState) -> None:
        retained = 0
        if self._outbox is not None:
            retained = conn.execute(
                sa.select(sa.func.count()).select_from(self._outbox).where(
                    self._outbox.c.transactional_id == self._tid,
                    self._outbox.c.prepared_txn_state == str(state),
                )
            ).scalar_one()
        anchor = state.anchor
        logger.error(
            "HEURISTIC OUTCOME for %r: the database committed the prepared Kafka transaction %s (first record "
            "%s), but Kafka aborted it (transaction.timeout.ms exceeded while its owner was down, or an operator "
            "terminated it): its records are not visible to read_committed consumers. %s",
            self._tid, state,
            f"{anchor[0].topic}-{anchor[0].partition}@{anchor[1]}" if anchor else "none",
            f"Re-publishing the {retained} records retained in {self._outbox.name}."  # type: ignore[union-attr]
            if retained and self._retain
            else "No retained records: re-create its records from the rows the database committed in that "
            "transaction, then produce them again.",
        )

    def _republish(
        self, conn: sa.Connection, producer: TwoPhaseCommitProducer, state: PreparedTxnState
    ) -> tuple[int, str | None]:
        """Re-publish the records retained for ``state`` as a new two-phase transaction on ``conn``.

        The normal path again, on the recovery's database transaction (the row
        is still locked): a crash anywhere in here leaves either the old state
        stored (the next recovery aborts this attempt and re-publishes again)
        or the new one (the next recovery commits it).  Exactly once either way.
        """
        outbox = self._outbox
        if outbox is None:
            return 0, None if state.is_empty else str(state)
        where = sa.and_(outbox.c.transactional_id == self._tid, outbox.c.prepared_txn_state == str(state))
        rows = conn.execute(sa.select(outbox).where(where).order_by(outbox.c.seq)).all()
        if not rows:
            conn.commit()
            return 0, str(state) if not state.is_empty else None
        producer.begin_transaction()
        self._step(Step.KAFKA_BEGUN)
        for row in rows:
            kwargs: dict[str, Any] = {"value": row.record_value, "key": row.record_key}
            if row.kafka_partition is not None:
                kwargs["partition"] = row.kafka_partition
            headers = _decode_headers(row.headers)
            if headers is not None:
                kwargs["headers"] = headers
            self._produce(producer, row.topic, kwargs)
        self._step(Step.BODY_DONE)
        new_state = producer.prepare_transaction(self._kafka_timeout_s)
        self._step(Step.PREPARED)
        conn.execute(sa.update(outbox).where(where).values(prepared_txn_state=str(new_state)))
        self._store_state(conn, new_state, None)  # the recovery holds the row lock
        self._step(Step.STATE_STORED)
        self._step(Step.DB_COMMITTING)
        conn.commit()
        self._last_state = str(new_state)
        self._outbox_dirty = True
        self._step(Step.DB_COMMITTED)
        producer.commit_transaction(self._kafka_timeout_s)
        self._step(Step.KAFKA_COMMITTED)
        self._republished += len(rows)
        logger.warning("%s: re-published %d retained records of %s as %s", self._tid, len(rows), state, new_state)
        return len(rows), str(new_state)


def recover_all(writers: Iterable[DualWriter], *, max_workers: int | None = None) -> dict[str, RecoveryResult]:
    """Recover many writers (one per instance or shard) in parallel; never raises.

    Returns one :class:`RecoveryResult` per transactional id.  A heuristic
    outcome is reported in the result (``result.heuristic``), any other
    failure in ``result.error``, so that one stuck shard does not hide the
    others: check both before starting work.
    """
    items = list(writers)
    if not items:
        return {}

    def one(writer: DualWriter) -> RecoveryResult:
        try:
            return writer.recover(raise_on_heuristic=False)
        except Exception as exc:  # noqa: BLE001 - reported per id
            logger.error("recovery of %r failed: %s", writer.transactional_id, exc)
            return RecoveryResult(writer.transactional_id, PreparedTxnState(), None, error=exc)

    with ThreadPoolExecutor(max_workers=max_workers or min(8, len(items)), thread_name_prefix="k2pc-recover") as pool:
        return {r.transactional_id: r for r in pool.map(one, items)}
