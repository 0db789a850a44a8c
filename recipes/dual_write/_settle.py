"""After the database COMMIT: an unknown COMMIT outcome, or a Kafka commit that failed.  Never guess:
read the decision back from the database (or the outcome from Kafka) and settle accordingly."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Final

import sqlalchemy as sa

from kafka2pc import (
    HeuristicOutcomeError,
    IndefiniteOutcomeError,
    Kafka2pcError,
    PreparedTxnState,
    ProducerFencedError,
)

from ._bind import Bound
from ._core import WriterCore
from ._lifecycle import WriterState
from ._recovery import Recovery, seconds_left

if TYPE_CHECKING:
    from kafka2pc import TwoPhaseCommitProducer

__all__ = ["Settler"]

logger = logging.getLogger("kafka2pc.recipes.dual_write._writer")

_SETTLE_LOCK_TIMEOUT_S: Final = 30.0


class Settler:
    """Settles a transaction whose database COMMIT raised, or whose Kafka commit failed (through the
    writer's :class:`Recovery` when it must)."""

    def __init__(self, core: WriterCore, recovery: Recovery) -> None:
        self._core = core
        self._recovery = recovery

    def settle_unknown_db_commit(
        self, bound: Bound, producer: TwoPhaseCommitProducer, state: PreparedTxnState, cause: BaseException
    ) -> bool:
        """COMMIT raised: read what the database decided and complete Kafka accordingly; True if committed."""
        core = self._core
        try:
            bound.rollback()  # no-op if the commit went through; releases a still-open transaction
        except sa.exc.SQLAlchemyError:
            logger.debug("%s: rollback after the failed COMMIT failed too (dead connection)", core.tid)
        # The row's new token is not known for sure: the next transaction recovers (and claims) first.
        core.to(WriterState.NEEDS_RECOVERY)
        try:
            with core.engine.connect() as conn, conn.begin():
                stored = core.store.read_settled(conn, core.tid, lock_timeout_s=_SETTLE_LOCK_TIMEOUT_S)
        except sa.exc.SQLAlchemyError as read_exc:
            core.doubt(state)
            logger.error(
                "%s: the database COMMIT failed (%r) and the stored state cannot be read (%r): Kafka "
                "transaction %s stays prepared until recover()", core.tid, cause, read_exc, state,
            )
            raise IndefiniteOutcomeError(
                f"{core.tid!r}: outcome of the database COMMIT unknown ({cause!r}) and the state row cannot be "
                f"read ({read_exc!r}); the Kafka transaction {state} stays prepared: call recover()",
                state=state,
            ) from cause
        committed = stored == str(state)
        logger.warning(
            "%s: the database COMMIT raised %r; the state row says it %s: %s the Kafka transaction",
            core.tid, cause, "committed" if committed else "rolled back", "committing" if committed else "aborting",
        )
        if committed:
            core.wrote(stored, core.token)
            core.mark_outbox(core.retain)
        deadline = self.kafka_deadline()
        try:
            core.kafka(lambda: producer.complete_transaction(core.parse(stored), seconds_left(deadline)))
        except Kafka2pcError as exc:
            if committed:
                self.after_kafka_commit_failure(producer, state, exc, deadline)
            else:
                logger.warning("%s: abort after a rolled-back COMMIT failed (%s)", core.tid, exc)
        return committed

    def kafka_deadline(self) -> float | None:
        """When the Kafka commit starting now, and any settlement after it, must end (``kafka_timeout_s``)."""
        core = self._core
        return None if core.kafka_timeout_s is None else time.monotonic() + core.kafka_timeout_s

    def after_kafka_commit_failure(
        self, producer: TwoPhaseCommitProducer, state: PreparedTxnState, cause: Kafka2pcError,
        deadline: float | None = None,
    ) -> None:
        """The database committed ``state`` but Kafka's commit failed: settle, never guess.

        With a ``deadline`` (``kafka_timeout_s`` after the Kafka commit began)
        the settlement ends by it; what it cannot settle in time stays in
        doubt, prepared in Kafka and committed in the database, for the next
        recovery to commit.
        """
        core = self._core
        core.doubt(state)
        if isinstance(cause, ProducerFencedError) or core.taken_over_now():
            # Another instance recovered this id: it read our state from the database and
            # settled our transaction.  Only look (recovering would fence it in turn).
            from kafka2pc import TransactionAdmin, TransactionOutcome

            core.to(WriterState.FENCED)
            admin = TransactionAdmin(core.config, control_plane=producer.control_plane)
            outcome = core.runtime.blocking(lambda: admin.transaction_outcome(core.tid, state, settled=True,
                                                                         timeout=seconds_left(deadline)))
            if outcome is TransactionOutcome.COMMITTED:
                logger.warning("%s: fenced during commit; the new owner committed %s", core.tid, state)
                core.settled()
                return
            if outcome is TransactionOutcome.ABORTED:
                core.count_heuristic()
                raise HeuristicOutcomeError(
                    f"{core.tid!r}: the database committed {state} but Kafka aborted it, and another instance "
                    "owns the id now (its recover() re-publishes retained records)",
                    transactional_id=core.tid, state=state, outcome="aborted",
                ) from cause
            raise IndefiniteOutcomeError(
                f"{core.tid!r}: fenced while committing {state}; its outcome is {outcome.value}", state=state
            ) from cause
        if deadline is not None and time.monotonic() >= deadline:
            if core.status is not WriterState.NEEDS_RECOVERY:
                core.to(WriterState.NEEDS_RECOVERY)
            logger.warning("%s: Kafka commit of %s failed (%s) and kafka_timeout_s=%g is spent: left in doubt",
                           core.tid, state, cause, core.kafka_timeout_s)
            raise IndefiniteOutcomeError(self._in_doubt_message(state, cause, None), state=state) from cause
        logger.warning("%s: Kafka commit of %s failed (%s): settling through recovery", core.tid, state, cause)
        try:
            self._recovery.recover(raise_on_heuristic=True, acknowledge=False, deadline=deadline)
        except HeuristicOutcomeError:
            raise
        except Kafka2pcError as exc:
            raise IndefiniteOutcomeError(self._in_doubt_message(state, cause, exc), state=state) from exc

    def _in_doubt_message(self, state: PreparedTxnState, cause: Kafka2pcError, settling: Kafka2pcError | None) -> str:
        core = self._core
        within = f" within kafka_timeout_s={core.kafka_timeout_s:g} s" if core.kafka_timeout_s is not None else ""
        tried = (f" and could not be settled{within} ({settling})" if settling is not None
                 else f", and no time was left{within} to settle it")
        return (
            f"{core.tid!r}: the database committed {state} but the Kafka commit failed ({cause}){tried}. The "
            "transaction is not lost: it stays in doubt (prepared in Kafka, committed in the database) and "
            "recover() -- or this writer's next transaction, which recovers first -- commits it: do not redo "
            "the transaction"
        )
