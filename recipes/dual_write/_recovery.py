"""The writer's recovery: claim the state row (committed), settle Kafka, then finish under the claim."""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kafka2pc import (
    DEFAULT_CLOSE_TIMEOUT_S,
    HeuristicOutcomeError,
    IllegalStateError,
    IndefiniteOutcomeError,
    PreparedTxnState,
)

from ._core import WriterCore
from ._lifecycle import WriterState
from ._store import TakenOver, locked
from ._values import MissingTableError, RecoveryResult, Step, _decode_headers

if TYPE_CHECKING:
    from kafka2pc import Settlement, TwoPhaseCommitProducer

__all__ = ["Recovery", "seconds_left"]

logger = logging.getLogger("kafka2pc.recipes.dual_write._writer")


def seconds_left(deadline: float | None) -> float | None:
    """The timeout for a Kafka call that must end by ``deadline`` (``None``: no deadline, the call's default).

    Never zero (a timeout must be positive): past the deadline the call fails at once.
    """
    return None if deadline is None else max(0.001, deadline - time.monotonic())


class Recovery:
    """KIP-939's recovery recipe for one writer (see :meth:`DualWriter.recover`): claim the state row
    (committed), settle Kafka with a new producer, then finish under the claim.  Counts what it did."""

    def __init__(self, core: WriterCore) -> None:
        self._core = core
        self.recoveries = 0
        self.republished = 0

    def recover(self, *, raise_on_heuristic: bool, acknowledge: bool, deadline: float | None = None) -> RecoveryResult:
        """Recover; with a ``deadline`` (``time.monotonic()``) every Kafka call ends by it."""
        core = self._core
        old = core.take_producer()
        if old is not None:
            try:
                old.close(seconds_left(deadline) or DEFAULT_CLOSE_TIMEOUT_S)
            except Exception:  # the new producer fences it anyway
                logger.debug("%s: closing the old producer failed", core.tid, exc_info=True)
        core.to(WriterState.RECOVERING)
        self.recoveries += 1
        core.wrote(core.last_state, None)
        try:
            try:
                result, heuristic_error = self._recover_steps(acknowledge, deadline)
            except sa.exc.DBAPIError as exc:
                missing = self._missing_table_error()
                if missing is None:
                    raise
                raise missing from exc
        except TakenOver as exc:
            raise core.fenced_error("the state row changed during the recovery") from exc
        except BaseException:
            core.to(WriterState.NEEDS_RECOVERY)
            raise
        core.to(WriterState.READY)
        core.settled()
        settlement = result.settlement
        assert settlement is not None
        logger.info(
            "%s: recovered (stored %s; %s -> %s%s)", core.tid, result.stored_state, settlement.plan.decision.value,
            settlement.outcome.value, f"; re-published {result.republished} records" if result.republished else "",
        )
        if heuristic_error is not None and raise_on_heuristic and not result.acknowledged:
            raise heuristic_error
        return result

    def _recover_steps(
        self, acknowledge: bool, deadline: float | None
    ) -> tuple[RecoveryResult, HeuristicOutcomeError | None]:
        core = self._core
        store = core.store
        # 1. The claim, committed before Kafka is touched: from here on no older writer's
        #    database commit can succeed (its token is void), whatever dies when.
        with core.engine.connect() as conn, conn.begin():
            claimed = locked(store, core.tid, "recover (claim the state row)",
                             lambda: store.claim(conn, core.tid, lock_timeout_s=core.lock_timeout_s))
            # Validated before the claim commits: a state of another id (or a malformed one) rolls the
            # claim back, so an operator's mistake fences no live writer.
            state = core.parse(claimed.state)
            state.check_transactional_id(core.tid)
            core.step(Step.RECOVERY_LOCKED)
        stored, token = claimed.state, claimed.token
        core.step(Step.RECOVERY_CLAIMED)
        # 2. Kafka: fence every older producer and settle the stored transaction.
        producer = core.new_producer()
        try:
            core.kafka(lambda: producer.init_transactions(seconds_left(deadline), keep_prepared_txn=True))
            settlement, heuristic_error = self._complete(producer, state, deadline)
        except BaseException:
            producer.close()
            raise
        core.install(producer)
        core.step(Step.RECOVERY_SETTLED)
        # 3. Under the claim (the row still carries its token): outbox, re-publication, acknowledgement.
        republished, acknowledged = 0, False
        with core.engine.connect() as conn:
            conn.begin()
            try:
                token = locked(store, core.tid, "recover (finish under the claim)",
                               lambda: store.touch(conn, core.tid, token, lock_timeout_s=core.lock_timeout_s))
                if heuristic_error is not None:
                    self._log_heuristic(conn, state)
                    if core.retain:
                        republished, stored, token = self._republish(conn, producer, state, stored, token,
                                                                     deadline)
                        if republished:
                            heuristic_error = None
                    if heuristic_error is not None and acknowledge:
                        token = store.store(conn, core.tid, None, token, stored)
                        stored, acknowledged = None, True
                        self._log_acknowledged(state)
                else:
                    # The stored transaction is settled: its copies are spent.  A zombie writer's open
                    # transaction may still lock them (it cannot commit any more): bounded, typed wait.
                    locked(store, core.tid, "recover (drop the settled transaction's outbox rows)",
                           lambda: core.delete_outbox(conn))
                if conn.in_transaction():
                    conn.commit()
                    if heuristic_error is None and not republished:
                        core.mark_outbox(False)
            except BaseException:
                try:
                    conn.rollback()
                except sa.exc.SQLAlchemyError:
                    logger.debug("%s: rollback of the recovery transaction failed", core.tid, exc_info=True)
                raise
        core.wrote(stored, token)
        return RecoveryResult(core.tid, state, settlement, republished, acknowledged=acknowledged), heuristic_error

    def _complete(
        self, producer: TwoPhaseCommitProducer, state: PreparedTxnState, deadline: float | None
    ) -> tuple[Settlement, HeuristicOutcomeError | None]:
        core = self._core
        from kafka2pc import Settlement, TransactionAdmin, TransactionOutcome

        for attempt in range(1, core.settle_attempts + 1):
            try:
                core.kafka(lambda: producer.complete_transaction(state, seconds_left(deadline)))
            except HeuristicOutcomeError as exc:
                core.count_heuristic()
                admin = TransactionAdmin(core.config, control_plane=producer.control_plane)
                plan = core.runtime.blocking(
                    functools.partial(admin.plan_recovery, core.tid, state, timeout=seconds_left(deadline))
                )
                return Settlement(plan, TransactionOutcome.ABORTED), exc
            except IndefiniteOutcomeError:
                pause = min(0.2 * 2**attempt, 5.0)
                if attempt == core.settle_attempts or (deadline is not None and time.monotonic() + pause > deadline):
                    raise
                logger.warning("%s: completing %s: outcome unknown, retrying (%d/%d)",
                               core.tid, state, attempt, core.settle_attempts)
                core.runtime.pause(pause)
                continue
            settled = producer.last_settlement
            if settled is None:
                raise IllegalStateError(f"{core.tid!r}: complete_transaction() reported no settlement")
            return settled, None
        raise IllegalStateError("unreachable: the last attempt returns or raises")  # pragma: no cover

    def _log_heuristic(self, conn: sa.Connection, state: PreparedTxnState) -> None:
        core = self._core
        retained = 0
        if core.outbox is not None:
            retained = conn.execute(
                sa.select(sa.func.count()).select_from(core.outbox).where(
                    core.outbox.c.transactional_id == core.tid,
                    core.outbox.c.prepared_txn_state == str(state),
                )
            ).scalar_one()
        anchor = state.anchor
        logger.error(
            "HEURISTIC OUTCOME for %r: the database committed the prepared Kafka transaction %s (first record "
            "%s), but Kafka aborted it (transaction.timeout.ms exceeded while its owner was down, or an operator "
            "terminated it): its records are not visible to read_committed consumers. %s",
            core.tid, state,
            f"{anchor[0].topic}-{anchor[0].partition}@{anchor[1]}" if anchor else "none",
            f"Re-publishing the {retained} records retained in {core.outbox.name}."  # type: ignore[union-attr]
            if retained and core.retain
            else "No retained records: re-create its records from the rows the database committed in that "
            "transaction, then produce them again.",
        )

    def _log_acknowledged(self, state: PreparedTxnState) -> None:
        core = self._core
        anchor = state.anchor
        logger.error(
            "HEURISTIC OUTCOME ACKNOWLEDGED for %r: the stored prepared state %s (first record %s), which the "
            "database committed and Kafka aborted, was cleared from %s; its records stay missing from Kafka "
            "unless re-produced from the rows that transaction committed",
            core.tid, state, f"{anchor[0].topic}-{anchor[0].partition}@{anchor[1]}" if anchor else "none",
            core.table.name,
        )

    def _republish(
        self, conn: sa.Connection, producer: TwoPhaseCommitProducer, state: PreparedTxnState,
        stored: str | None, token: str, deadline: float | None,
    ) -> tuple[int, str | None, str]:
        """Re-publish the records retained for ``state`` as a new two-phase transaction on ``conn``.

        The normal path again, on the recovery's database transaction (the row
        is still locked): a crash anywhere in here leaves either the old state
        stored (the next recovery aborts this attempt and re-publishes again)
        or the new one (the next recovery commits it).  Exactly once either way.
        Returns the count, the stored state and the row's token afterwards.
        """
        core = self._core
        outbox = core.outbox
        if outbox is None:
            return 0, stored, token
        where = sa.and_(outbox.c.transactional_id == core.tid, outbox.c.prepared_txn_state == str(state))
        rows = conn.execute(sa.select(outbox).where(where).order_by(outbox.c.seq)).all()
        if not rows:
            return 0, stored, token
        core.kafka(producer.begin_transaction)
        core.step(Step.KAFKA_BEGUN)
        for row in rows:
            kwargs: dict[str, Any] = {"value": row.record_value, "key": row.record_key}
            if row.kafka_partition is not None:
                kwargs["partition"] = row.kafka_partition
            headers = _decode_headers(row.headers)
            if headers is not None:
                kwargs["headers"] = headers
            core.produce(producer, row.topic, kwargs)
        core.step(Step.BODY_DONE)
        timeout = core.kafka_timeout_s if deadline is None else seconds_left(deadline)
        new_state = core.kafka(lambda: producer.prepare_transaction(timeout))
        core.step(Step.PREPARED)
        conn.execute(sa.update(outbox).where(where).values(prepared_txn_state=str(new_state)))
        token = core.store.store(conn, core.tid, str(new_state), token, stored)
        core.step(Step.STATE_STORED)
        core.step(Step.DB_COMMITTING)
        conn.commit()
        core.wrote(str(new_state), token)
        core.mark_outbox(True)
        core.step(Step.DB_COMMITTED)
        timeout = core.kafka_timeout_s if deadline is None else seconds_left(deadline)
        core.kafka(lambda: producer.commit_transaction(timeout))
        core.step(Step.KAFKA_COMMITTED)
        self.republished += len(rows)
        logger.warning("%s: re-published %d retained records of %s as %s", core.tid, len(rows), state, new_state)
        return len(rows), str(new_state), token

    def _missing_table_error(self) -> MissingTableError | None:
        """After a database error: the error naming a missing state or outbox table, if one is missing."""
        core = self._core
        tables = [core.table] + ([core.outbox] if core.retain and core.outbox is not None else [])
        try:
            with core.engine.connect() as conn:
                inspector = sa.inspect(conn)
                missing = [t for t in tables if not inspector.has_table(t.name, schema=t.schema)]
        except sa.exc.SQLAlchemyError:
            return None
        if not missing:
            return None
        names = ", ".join(t.fullname for t in missing)
        return MissingTableError(
            f"{core.tid!r}: the table {names} does not exist in "
            f"{core.engine.url.render_as_string(hide_password=True)}. "
            "Create it once with the application's tables: define_state_table(metadata)"
            f"{' and define_outbox_table(metadata)' if core.retain else ''} on your MetaData, then "
            "metadata.create_all(engine) (or an Alembic migration); writer.create_tables() does it for scripts"
        )
