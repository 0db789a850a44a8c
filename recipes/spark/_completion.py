"""Completing a decision through the transaction coordinator, sweeping strays, and the repair check.

Driver side, no Spark: the functions here settle one sink's transactional ids
through :class:`kafka2pc.TransactionAdmin`, the core's recovery facade (it
waits out the markers and asks again for unknown outcomes; none of that
policy is repeated here).  :func:`repair_mismatch` is pure: it compares what
a decision recorded with a replay of the batch.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from kafka2pc import Decision, Kafka2pcError, Settlement, TransactionAdmin, TransactionOutcome

from ._values import (
    PartitionResult,
    SinkCompletionError,
    SinkDecision,
    SinkRecovery,
    SinkTransaction,
    SinkWriteError,
    UnknownTopicError,
    combine_fingerprints,
)

logger = logging.getLogger("kafka2pc.recipes.spark_sink")

_UNKNOWN_OUTCOME_WAIT_S: Final = 60.0
"""How long a decided transaction's unknown outcome is asked again before the batch fails."""


@dataclass
class Completion:
    """What completing one decision found."""

    committed: int = 0
    strays_aborted: int = 0
    aborted: list[int] = field(default_factory=list)
    """Partitions whose decided transaction Kafka aborted (to repair)."""
    visible_at: float = 0.0
    """``time.monotonic()`` when the last decided transaction was committed (before the stray sweep)."""


def complete(
    admin: TransactionAdmin, transactional_id_base: str, decision: SinkDecision, after_first: Callable[[], None],
    *, keep: frozenset[str] = frozenset(),
) -> Completion:
    """Commit every transaction the decision names; abort every other open one of the sink but ``keep``."""
    result = Completion()
    by_tid = decision.by_transactional_id()
    unknown: dict[str, SinkTransaction] = {}
    first = [True]

    def settled(tid: str, settlement: Settlement) -> None:
        txn = by_tid[tid]
        if settlement.outcome is TransactionOutcome.COMMITTED:
            result.committed += 1
        elif settlement.outcome is TransactionOutcome.ABORTED:
            result.aborted.append(txn.partition)
        elif settlement.outcome is not TransactionOutcome.NONE:
            unknown[tid] = txn
        if first[0]:
            first[0] = False
            after_first()

    admin.settle_many({t.transactional_id: t.prepared_state for t in decision.transactions},
                      fence=False, on_heuristic="report", on_settled=settled)
    result.visible_at = time.monotonic()  # the markers are written: the rows are visible...
    result.strays_aborted = settle_open(admin, transactional_id_base, by_tid, keep=keep)
    if result.strays_aborted:  # ...unless a stray open transaction held the partition's last stable offset back
        result.visible_at = time.monotonic()
    if unknown:
        # The last stable offset was held back (e.g. by a stray just aborted): ask again.
        outcomes = admin.outcomes_of_settled({tid: t.prepared_state for tid, t in unknown.items()},
                                             wait_s=_UNKNOWN_OUTCOME_WAIT_S)
        still = []
        for tid, txn in unknown.items():
            if outcomes[tid] is TransactionOutcome.COMMITTED:
                result.committed += 1
            elif outcomes[tid] is TransactionOutcome.ABORTED:
                result.aborted.append(txn.partition)
            else:
                still.append(txn.state)
        result.visible_at = time.monotonic()
        if still:
            raise SinkCompletionError(f"batch {decision.batch_id}: the outcome of {still} stays unknown")
    return result


def settle_open(
    admin: TransactionAdmin, transactional_id_base: str, named: Mapping[str, SinkTransaction],
    *, keep: frozenset[str] = frozenset(),
) -> int:
    """Settle every open transaction under the sink's ids (but ``keep``): commit it if ``named`` names it, else abort.

    The sink's ids are ``<base>-<partition>`` and, for the data source's task
    attempts, ``<base>-<partition>.<slot>.<attempt>``.
    A transaction no decision names (a crashed run's, a zombie attempt's, a
    failed batch's) is aborted with KIP-939's ``forceTerminateTransaction``
    (InitProducerId), which also bumps the epoch and so fences a zombie
    producer still running.  Returns how many transactions were aborted.
    """
    return settle_open_recovery(admin, transactional_id_base, named, keep=keep).aborted


def settle_open_recovery(
    admin: TransactionAdmin, transactional_id_base: str, named: Mapping[str, SinkTransaction],
    *, keep: frozenset[str] = frozenset(),
) -> SinkRecovery:
    """:func:`settle_open`, counting the commits as well as the aborts."""
    pattern = re.compile(re.escape(transactional_id_base) + r"-\d+(?:\.\d+\.\d+)?")
    decisions = admin.settle_open(
        lambda tid: pattern.fullmatch(tid) is not None and tid not in keep,
        {tid: t.prepared_state for tid, t in named.items()},
    )
    return SinkRecovery(sum(d is Decision.COMMIT for d in decisions.values()),
                        sum(d is Decision.ABORT for d in decisions.values()))


def repair_mismatch(
    recorded: Sequence[SinkTransaction], replay: Sequence[PartitionResult], whole_batch: bool
) -> str | None:
    """Why a replay may not repair a decision, or ``None`` if it may.

    ``whole_batch``: every decided transaction was aborted, so the replay
    rewrites the whole batch in whatever partitioning it has now; only the
    batch's total row count and fingerprint must match.  Otherwise the
    replay rewrites some partitions and keeps the others' committed rows, so
    every partition must hold what the decision recorded (count, and the
    fingerprint where the decision has one).
    """
    if whole_batch:
        want_rows = sum(t.records for t in recorded)
        got_rows = sum(r.records for r in replay)
        if want_rows != got_rows:
            return f"the decision recorded {want_rows} rows, the replay has {got_rows}"
        if all(t.fingerprint is not None for t in recorded):
            want = combine_fingerprints(t.fingerprint for t in recorded if t.fingerprint is not None)
            got = combine_fingerprints(r.fingerprint for r in replay)
            if want != got:
                return f"the batch's rows differ (fingerprint {got}, recorded {want})"
        return None
    want_parts = {t.partition: (t.records, t.fingerprint) for t in recorded}
    got_parts = {r.partition: (r.records, r.fingerprint) for r in replay}
    differ = sorted(
        p for p in set(want_parts) | set(got_parts)
        if p not in want_parts or p not in got_parts or want_parts[p][0] != got_parts[p][0]
        or (want_parts[p][1] is not None and want_parts[p][1] != got_parts[p][1])
    )
    if not differ:
        return None
    return (
        "the replayed batch is cut into partitions differently, or its rows changed: recorded "
        + _describe({p: v[0] for p, v in want_parts.items()}) + ", replayed "
        + _describe({p: v[0] for p, v in got_parts.items()}) + f" (partitions {differ} differ)"
    )


def _describe(rows: Mapping[int, int]) -> str:
    return "{" + ", ".join(f"p{p}: {n} rows" for p, n in sorted(rows.items())) + "}"


_UNKNOWN_TOPIC_RE: Final = re.compile(r"UnknownTopicError: (topic '[^\n]*)")


def job_error(batch_id: int, exc: Exception, aborted: int) -> Kafka2pcError:
    """The error a failed write job surfaces as: the task's own message, not a JVM stack trace."""
    text = str(exc)
    missing = _UNKNOWN_TOPIC_RE.search(text)
    if missing is not None:
        return UnknownTopicError(f"batch {batch_id}: {missing.group(1).strip()}; the {aborted} transactions "
                                 "the batch had prepared were aborted")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # The Python traceback of the failed task is inside the JVM's message: its
    # last "SomeError: message" line is the task's own error.
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)
              and not line.startswith(("org.apache.", "java.", "py4j.", "pyspark.errors."))]
    summary = errors[-1] if errors else (lines[0] if lines else type(exc).__name__)
    return SinkWriteError(
        f"batch {batch_id}: the write job failed before the decision ({summary[:500]}); the {aborted} "
        "transactions it had prepared were aborted"
    )


def repair_refusal(decision: SinkDecision, lost: frozenset[int], problem: str, location: str) -> str:
    """The message of a refused repair: what differs, and what the operator can do."""
    kept = sorted({t.partition for t in decision.transactions} - lost)
    return (
        f"batch {decision.batch_id}: cannot repair: Kafka aborted the decided transactions of partitions "
        f"{sorted(lost)} (revision {decision.revision}), while partitions {kept} committed, and {problem}. "
        "Rewriting would lose or duplicate rows, so nothing was written. Restart the query with the "
        "partitioning of the run that wrote the decision (same number of cores or spark.default.parallelism, "
        "same spark.sql.files.maxPartitionBytes / openCostInBytes, same input files); the decision is "
        f"{location}/{decision.batch_id:019d}.{decision.revision:06d}.json. See docs/spark-recovery.md, "
        "'Repair'."
    )
