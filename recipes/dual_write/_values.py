"""The recipe's value types: steps, results, metrics, errors, and the record codec of the outbox."""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kafka2pc import Kafka2pcError, PreparedTxnState, UsageError

if TYPE_CHECKING:
    from kafka2pc import Decision, Settlement


_ON_HEURISTIC = ("raise", "report", "acknowledge")


def heuristic_flags(
    where: str, on_heuristic: str, raise_on_heuristic: bool | None, acknowledge_heuristic: bool | None
) -> tuple[bool, bool]:
    """``(raise, acknowledge)`` for ``on_heuristic``, or for the deprecated 0.1 flags when one is given."""
    from kafka2pc._deprecation import renamed

    if on_heuristic not in _ON_HEURISTIC:
        raise UsageError(f"{where}: on_heuristic must be one of {', '.join(map(repr, _ON_HEURISTIC))}, "
                         f"not {on_heuristic!r}")
    if raise_on_heuristic is None and acknowledge_heuristic is None:
        return on_heuristic == "raise", on_heuristic == "acknowledge"
    if on_heuristic != "raise":
        raise UsageError(f"{where}: give on_heuristic or the deprecated raise_on_heuristic/acknowledge_heuristic, "
                         "not both")
    if raise_on_heuristic is not None:
        renamed(f"{where}(raise_on_heuristic=...)", "on_heuristic='raise' or 'report'", stacklevel=4)
    if acknowledge_heuristic is not None:
        renamed(f"{where}(acknowledge_heuristic=...)", "on_heuristic='acknowledge'", stacklevel=4)
    return raise_on_heuristic is not False, bool(acknowledge_heuristic)

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
    """Recovery locked the state row and read the stored state; its claim is not committed yet."""
    RECOVERY_CLAIMED = "recovery_claimed"
    """Recovery committed its claim on the state row (every older writer's database side is fenced);
    Kafka is not touched yet."""
    RECOVERY_SETTLED = "recovery_settled"
    """Recovery settled the Kafka transaction; its database transaction is still open."""

    # -- what each step means for an observer (kafka2pc.otel reads these, never the names) --
    @property
    def attempt_begins(self) -> bool:
        """A transaction or a recovery begins: whatever phase the writer's previous attempt left open ended
        without completing."""
        return self in (Step.DB_BEGUN, Step.RECOVERY_LOCKED)

    @property
    def phase_begins(self) -> str | None:
        """The phase this step begins: ``"recovery"``, ``"prepare"``, ``"db_commit"``, ``"kafka_commit"`` or
        ``None`` (each phase ends at the step whose :attr:`phase_ends` names it)."""
        return _PHASE_BEGINS.get(self)

    @property
    def phase_ends(self) -> str | None:
        """The phase this step ends (see :attr:`phase_begins`), or ``None``."""
        return _PHASE_ENDS.get(self)

    @property
    def leaves_prepared(self) -> bool:
        """From this step on the Kafka transaction is prepared (until a step that :attr:`settles` it)."""
        return self is Step.PREPARED

    @property
    def settles(self) -> bool:
        """Nothing stays prepared after this step: the Kafka transaction committed, or recovery settled it."""
        return self in (Step.KAFKA_COMMITTED, Step.RECOVERY_SETTLED)


_PHASE_BEGINS: dict[Step, str] = {
    Step.RECOVERY_LOCKED: "recovery", Step.BODY_DONE: "prepare", Step.DB_COMMITTING: "db_commit",
    Step.DB_COMMITTED: "kafka_commit",
}
_PHASE_ENDS: dict[Step, str] = {
    Step.RECOVERY_SETTLED: "recovery", Step.PREPARED: "prepare", Step.DB_COMMITTED: "db_commit",
    Step.KAFKA_COMMITTED: "kafka_commit",
}


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
    acknowledged: bool = False
    """True when a heuristic outcome was acknowledged (``recover(on_heuristic="acknowledge")``):
    the stored state was cleared after its details were logged, so later recoveries start clean."""

    @property
    def heuristic(self) -> bool:
        """True when Kafka had aborted the transaction the database committed."""
        return self.settlement is not None and self.settlement.heuristic

    @property
    def decision(self) -> Decision:
        """What recovery did to the transaction the previous owner left open.

        :attr:`~kafka2pc.Decision.COMMIT` (it was the one the database
        committed), :attr:`~kafka2pc.Decision.ABORT` (any other) or
        :attr:`~kafka2pc.Decision.NOTHING` (none was open, or the recovery
        failed: see :attr:`error`).
        """
        from kafka2pc import Decision

        return Decision.NOTHING if self.settlement is None else self.settlement.plan.decision

    @property
    def ok(self) -> bool:
        """True when the writer may take new work: no error, and no heuristic outcome left unresolved.

        A heuristic outcome counts as resolved once its records were
        re-published (``retain_records=True``) or it was acknowledged.

        Example::

            results = recover_all(writers)
            if not all(r.ok for r in results.values()):
                raise SystemExit(f"recovery failed: {results}")
        """
        if self.error is not None:
            return False
        return not self.heuristic or self.acknowledged or self.republished > 0


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


class StateRowLockedError(Kafka2pcError, sa.exc.OperationalError):
    """The state row's lock (SQLite: the database's write lock) could not be had in time.

    Another instance (or ``kafka2pc recover``) holds it: typically a writer
    with the same transactional id in the middle of a transaction.  Raised
    by ``recover()`` before anything changed (retry later), or, with
    ``retain_records=True``, after it settled Kafka when a taken-over writer's
    open transaction still locks the id's outbox rows (that writer can no
    longer commit; the next ``recover()`` finishes once it is gone).  Also a
    ``sqlalchemy.exc.OperationalError`` (the database's own error is
    ``orig``), so existing handlers of that keep working.
    """

    transactional_id: str

    @classmethod
    def wrap(cls, exc: sa.exc.DBAPIError, transactional_id: str, action: str) -> StateRowLockedError:
        """The typed error for the lock-timeout ``exc`` met while doing ``action``."""
        error = cls(exc.statement, exc.params, exc.orig)  # type: ignore[arg-type]
        error.transactional_id = transactional_id
        error.action = action
        return error

    action: str = ""

    def __str__(self) -> str:
        return (
            f"{self.transactional_id!r}: {self.action}: the state row is locked by another instance (or "
            f"`kafka2pc recover`); nothing was changed, retry later ({self.orig})"
        )


class TransactionMisuseError(UsageError):
    """The application committed, rolled back or closed the database transaction bound to
    :meth:`DualWriter.transaction` inside its block.

    The recipe commits (or rolls back) that transaction itself, together with
    the Kafka transaction.  A commit inside the block is refused (the database
    transaction is rolled back instead), a rollback or close is let through;
    either way the Kafka transaction is aborted and the block fails with this
    error: neither side keeps the transaction's writes.  Savepoints
    (``Session.begin_nested()``, ``Connection.begin_nested()``) are fine.
    """


class MissingTableError(UsageError):
    """The state table (or, with ``retain_records=True``, the outbox table) does not exist.

    Create it once, like any other table of the application:
    ``define_state_table(metadata)`` (and ``define_outbox_table(metadata)``) on the
    application's ``MetaData``, then ``metadata.create_all(engine)`` or an
    Alembic migration; ``writer.create_tables()`` does it for scripts and tests.
    """


