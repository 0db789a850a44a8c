"""Values of the Spark sink: decisions, task results, metrics, the driver's named steps, errors.

Pure data, no Spark and no network: the decision stores, the executor side and
the driver side all speak in these types.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from kafka2pc import Kafka2pcError, PreparedTxnState, UsageError
from kafka2pc import UnknownTopicError as _CoreUnknownTopicError
from kafka2pc._deprecation import deprecated_property

DECISION_FORMAT: Final = "kafka2pc-spark-decision/1"


@dataclass(frozen=True)
class SinkTransaction:
    """One prepared transaction named by a decision: partition ``partition`` of the batch."""

    partition: int
    transactional_id: str
    state: str
    records: int
    fingerprint: str | None = None
    """Order-independent hash of the partition's rows (see :func:`combine_fingerprints`); ``None`` in old decisions."""

    @property
    def prepared_state(self) -> PreparedTxnState:
        """The parsed :class:`~kafka2pc.PreparedTxnState`."""
        return PreparedTxnState(self.state)


@dataclass(frozen=True)
class SinkDecision:
    """The commit decision for one micro-batch: exactly these transactions are to commit.

    ``revision`` grows when a repair replaces the state of a partition whose
    transaction Kafka aborted; the highest revision of a batch is the decision.
    ``created_s`` is when it was written (seconds since the epoch, ``0.0`` if unknown).
    """

    sink_id: str
    batch_id: int
    revision: int
    transactions: tuple[SinkTransaction, ...]
    created_s: float = 0.0

    created_ms = deprecated_property("created_ms", "created_s", lambda self: int(self.created_s * 1000))

    def to_json(self) -> bytes:
        """Serialize (UTF-8 JSON, one object)."""
        return json.dumps(
            {
                "format": DECISION_FORMAT,
                "sink_id": self.sink_id,
                "batch_id": self.batch_id,
                "revision": self.revision,
                "created_ms": int(self.created_s * 1000),  # the file format keeps its field
                "transactions": [dataclasses.asdict(t) for t in self.transactions],
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> SinkDecision:
        """Parse what :meth:`to_json` wrote; raise :class:`~kafka2pc.UsageError` on anything else."""
        try:
            obj = json.loads(data)
            if obj.get("format") != DECISION_FORMAT:
                raise ValueError(f"unknown format {obj.get('format')!r}")
            txns = tuple(
                SinkTransaction(int(t["partition"]), str(t["transactional_id"]), str(t["state"]), int(t["records"]),
                                None if t.get("fingerprint") is None else str(t["fingerprint"]))
                for t in obj["transactions"]
            )
            for txn in txns:
                PreparedTxnState(txn.state)  # validate
            return cls(str(obj["sink_id"]), int(obj["batch_id"]), int(obj["revision"]), txns,
                       int(obj.get("created_ms", 0)) / 1000)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UsageError(f"corrupt sink decision: {exc}") from exc

    def by_transactional_id(self) -> dict[str, SinkTransaction]:
        """The named transactions keyed by transactional id."""
        return {t.transactional_id: t for t in self.transactions}


@dataclass(frozen=True)
class PartitionResult:
    """What one task attempt returns to the driver after preparing its partition's transaction."""

    partition: int
    attempt: int
    transactional_id: str
    state: str
    records: int
    open_s: float
    write_s: float
    prepare_s: float
    fingerprint: str = ""
    """Order-independent hash of the rows (16 hex digits); see :func:`combine_fingerprints`."""

    @property
    def written(self) -> bool:
        """``False`` for a partition a repair run only read (to check its rows), wrote nothing for."""
        return bool(self.state)


RESULT_COLUMNS: Final = tuple(f.name for f in dataclasses.fields(PartitionResult))
RESULT_DDL: Final = (
    "partition int, attempt int, transactional_id string, state string, records long, "
    "open_s double, write_s double, prepare_s double, fingerprint string"
)

_MASK64: Final = (1 << 64) - 1


def combine_fingerprints(parts: Iterable[str | int]) -> str:
    """The fingerprint of a union of row sets: the sum of their fingerprints modulo 2**64, as 16 hex digits.

    A row's hash is Spark's ``xxhash64`` of its columns; a set of rows hashes to
    the sum of its rows' hashes, so the value does not depend on row order or
    on how the rows are cut into partitions.
    """
    total = 0
    for part in parts:
        total += int(part, 16) if isinstance(part, str) else part
    return f"{total & _MASK64:016x}"


@dataclass(frozen=True)
class BatchMetrics:
    """What the sink did for one micro-batch (also logged at INFO).

    ``stray_transactions_aborted`` counts open transactions of this sink that
    the batch's decision does not name (zombie attempts) aborted after the
    commit; ``leftovers_aborted`` those of a crashed run aborted before the
    first write of this driver process.  ``task_attempts`` maps each
    partition to the attempt number whose result was used.
    ``write_s`` is the Spark job that writes and prepares; ``task_open_s``,
    ``task_write_s`` and ``task_prepare_s`` are the slowest task's time to open
    its transaction (``init_transactions``, which fences other attempts), to
    produce its rows, and to prepare (flush).
    ``time_to_visibility_s`` runs from the call of the sink to the last commit
    (the batch's rows are then visible to ``read_committed`` consumers);
    ``commit_latency_s`` is the part the two-phase commit adds after the last
    task finished: writing the decision plus committing the transactions.
    ``completion_s`` also holds the sweep for stray transactions that follows
    the commits (the batch's rows are already visible then, unless the sweep
    aborted a stray that held them back: the time to visibility then ends
    after the sweep).
    """

    batch_id: int
    replayed: bool
    records: int
    partitions: int
    transactions_prepared: int
    transactions_committed: int
    stray_transactions_aborted: int
    leftovers_aborted: int
    repaired_partitions: tuple[int, ...]
    task_attempts: Mapping[int, int]
    settle_s: float
    write_s: float
    task_open_s: float
    task_write_s: float
    task_prepare_s: float
    decision_s: float
    completion_s: float
    time_to_visibility_s: float
    commit_latency_s: float
    sink_id: str = ""
    """The sink id whose transactions the batch wrote (``q``/``r`` + 16 hex digits when derived)."""

    @property
    def rows_per_second(self) -> float:
        """Records divided by time to visibility."""
        return self.records / self.time_to_visibility_s if self.time_to_visibility_s > 0 else 0.0


@dataclass(frozen=True)
class SinkRecovery:
    """What a recovery of a Spark write did: the ``foreachBatch`` sink's ``recover`` and the data source's.

    ``committed`` counts the open transactions the last durable decision
    names, committed now; ``aborted`` every other open transaction of the
    write's ids (a crashed run's, a zombie attempt's).  Both ``0``: nothing
    was left open.
    """

    committed: int = 0
    aborted: int = 0

    def __add__(self, other: SinkRecovery) -> SinkRecovery:
        return SinkRecovery(self.committed + other.committed, self.aborted + other.aborted)


class SinkStep(str, enum.Enum):
    """Named points of a batch on the driver, passed to the sink's ``on_step`` hook.

    A testing and tracing aid, like the dual-write recipe's ``Step``: crash
    tests kill the driver process at one of these points.  The hook receives
    the step and the batch id.
    """

    AFTER_PREPARE = "after_prepare"
    """Every task prepared its transaction; no decision exists yet."""
    AFTER_DECISION = "after_decision"
    """The decision is durable (the commit point); nothing is committed yet."""
    MID_COMPLETION = "mid_completion"
    """The decision's first transaction was completed, the others not yet."""


SinkStepHook = Callable[[SinkStep, int], None]
"""The driver-side hook: ``on_step(step, batch_id)`` (the dual-write recipe's ``StepHook`` takes a ``Step``)."""


class SinkCompletionError(Kafka2pcError):
    """The sink could not complete a batch's decision (the batch fails; a restart retries it)."""


class SinkRepairError(SinkCompletionError):
    """A repair was refused: the replayed batch does not match what the decision recorded.

    Writing it would lose or duplicate rows, so nothing was written (what the
    repair prepared is aborted).  The message says what differs and what the
    operator can do; ``docs/spark-recovery.md`` (*Repair*) explains it.
    """


class SinkWriteError(Kafka2pcError):
    """A batch's write job failed before its decision existed.

    Every transaction it prepared was aborted before this was raised (nothing
    was decided, so nothing may commit); Spark fails the batch and a restart
    writes it again.  The cause is chained.
    """


UnknownTopicError = _CoreUnknownTopicError
"""A row (or the ``topic`` option) names a topic that does not exist: :class:`kafka2pc.UnknownTopicError`."""
