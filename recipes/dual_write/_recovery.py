"""The writer's recovery: claim the state row (committed), settle Kafka, then finish under the claim."""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kafka2pc import (
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

__all__ = ["Recovering", "seconds_left"]

logger = logging.getLogger("kafka2pc.recipes.dual_write._writer")


def seconds_left(deadline: float | None) -> float | None:
    """The timeout for a Kafka call that must end by ``deadline`` (``None``: no deadline, the call's default).

    Never zero (a timeout must be positive): past the deadline the call fails at once.
    """
    return None if deadline is None else max(0.001, deadline - time.monotonic())


class Recovering(WriterCore):
    """KIP-939's recovery recipe for one writer (see :meth:`DualWriter.recover`)."""

    def _recover(self, *, raise_on_heuristic: bool, acknowledge: bool, deadline: float | None = None) -> RecoveryResult:
        """Recover; with a ``deadline`` (``time.monotonic()``) every Kafka call ends by it."""
        old, self._producer = self._producer, None
        if old is not None:
            try:
                old.close(seconds_left(deadline) or 30.0)
            except Exception:  # the new producer fences it anyway
                logger.debug("%s: closing the old producer failed", self._tid, exc_info=True)
        self._to(WriterState.RECOVERING)
        self._recoveries += 1
        self._token = None
        try:
            try:
                result, heuristic_error = self._recover_steps(acknowledge, deadline)
            except sa.exc.DBAPIError as exc:
                missing = self._missing_table_error()
                if missing is None:
                    raise
                raise missing from exc
        except TakenOver as exc:
            raise self._fenced_error("the state row changed during the recovery") from exc
        except BaseException:
            self._to(WriterState.NEEDS_RECOVERY)
            raise
        self._to(WriterState.READY)
        self._in_doubt = self._in_doubt_since = None
        settlement = result.settlement
        assert settlement is not None
        logger.info(
            "%s: recovered (stored %s; %s -> %s%s)", self._tid, result.stored_state, settlement.plan.decision.value,
            settlement.outcome.value, f"; re-published {result.republished} records" if result.republished else "",
        )
        if heuristic_error is not None and raise_on_heuristic and not result.acknowledged:
            raise heuristic_error
        return result

    def _recover_steps(
        self, acknowledge: bool, deadline: float | None
    ) -> tuple[RecoveryResult, HeuristicOutcomeError | None]:
        store = self._store
        # 1. The claim, committed before Kafka is touched: from here on no older writer's
        #    database commit can succeed (its token is void), whatever dies when.
        with self._engine.connect() as conn, conn.begin():
            claimed = locked(store, self._tid, "recover (claim the state row)",
                             lambda: store.claim(conn, self._tid, lock_timeout_s=self._lock_timeout_s))
            # Validated before the claim commits: a state of another id (or a malformed one) rolls the
            # claim back, so an operator's mistake fences no live writer.
            state = self._parse(claimed.state)
            state.check_transactional_id(self._tid)
            self._step(Step.RECOVERY_LOCKED)
        stored, token = claimed.state, claimed.token
        self._step(Step.RECOVERY_CLAIMED)
        # 2. Kafka: fence every older producer and settle the stored transaction.
        producer = self._new_producer()
        try:
            self._kafka(lambda: producer.init_transactions(seconds_left(deadline), keep_prepared_txn=True))
            settlement, heuristic_error = self._complete(producer, state, deadline)
        except BaseException:
            producer.close()
            raise
        self._producer = producer
        self._step(Step.RECOVERY_SETTLED)
        # 3. Under the claim (the row still carries its token): outbox, re-publication, acknowledgement.
        republished, acknowledged = 0, False
        with self._engine.connect() as conn:
            conn.begin()
            try:
                token = locked(store, self._tid, "recover (finish under the claim)",
                               lambda: store.touch(conn, self._tid, token, lock_timeout_s=self._lock_timeout_s))
                if heuristic_error is not None:
                    self._log_heuristic(conn, state)
                    if self._retain:
                        republished, stored, token = self._republish(conn, producer, state, stored, token,
                                                                     deadline)
                        if republished:
                            heuristic_error = None
                    if heuristic_error is not None and acknowledge:
                        token = store.store(conn, self._tid, None, token, stored)
                        stored, acknowledged = None, True
                        self._log_acknowledged(state)
                else:
                    # The stored transaction is settled: its copies are spent.  A zombie writer's open
                    # transaction may still lock them (it cannot commit any more): bounded, typed wait.
                    locked(store, self._tid, "recover (drop the settled transaction's outbox rows)",
                           lambda: self._delete_outbox(conn))
                if conn.in_transaction():
                    conn.commit()
                    if heuristic_error is None and not republished:
                        self._outbox_dirty = False
            except BaseException:
                try:
                    conn.rollback()
                except sa.exc.SQLAlchemyError:
                    logger.debug("%s: rollback of the recovery transaction failed", self._tid, exc_info=True)
                raise
        self._last_state, self._token = stored, token
        return RecoveryResult(self._tid, state, settlement, republished, acknowledged=acknowledged), heuristic_error

    def _complete(
        self, producer: TwoPhaseCommitProducer, state: PreparedTxnState, deadline: float | None
    ) -> tuple[Settlement, HeuristicOutcomeError | None]:
        from kafka2pc import Settlement, TransactionAdmin, TransactionOutcome

        for attempt in range(1, self._settle_attempts + 1):
            try:
                self._kafka(lambda: producer.complete_transaction(state, seconds_left(deadline)))
            except HeuristicOutcomeError as exc:
                self._heuristics += 1
                admin = TransactionAdmin(self._config, control_plane=producer.control_plane)
                plan = self._blocking(
                    functools.partial(admin.plan_recovery, self._tid, state, timeout=seconds_left(deadline))
                )
                return Settlement(plan, TransactionOutcome.ABORTED), exc
            except IndefiniteOutcomeError:
                pause = min(0.2 * 2**attempt, 5.0)
                if attempt == self._settle_attempts or (deadline is not None and time.monotonic() + pause > deadline):
                    raise
                logger.warning("%s: completing %s: outcome unknown, retrying (%d/%d)",
                               self._tid, state, attempt, self._settle_attempts)
                self._pause(pause)
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

    def _log_acknowledged(self, state: PreparedTxnState) -> None:
        anchor = state.anchor
        logger.error(
            "HEURISTIC OUTCOME ACKNOWLEDGED for %r: the stored prepared state %s (first record %s), which the "
            "database committed and Kafka aborted, was cleared from %s; its records stay missing from Kafka "
            "unless re-produced from the rows that transaction committed",
            self._tid, state, f"{anchor[0].topic}-{anchor[0].partition}@{anchor[1]}" if anchor else "none",
            self._table.name,
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
        outbox = self._outbox
        if outbox is None:
            return 0, stored, token
        where = sa.and_(outbox.c.transactional_id == self._tid, outbox.c.prepared_txn_state == str(state))
        rows = conn.execute(sa.select(outbox).where(where).order_by(outbox.c.seq)).all()
        if not rows:
            return 0, stored, token
        self._kafka(producer.begin_transaction)
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
        timeout = self._kafka_timeout_s if deadline is None else seconds_left(deadline)
        new_state = self._kafka(lambda: producer.prepare_transaction(timeout))
        self._step(Step.PREPARED)
        conn.execute(sa.update(outbox).where(where).values(prepared_txn_state=str(new_state)))
        token = self._store.store(conn, self._tid, str(new_state), token, stored)
        self._step(Step.STATE_STORED)
        self._step(Step.DB_COMMITTING)
        conn.commit()
        self._last_state, self._token = str(new_state), token
        self._outbox_dirty = True
        self._step(Step.DB_COMMITTED)
        timeout = self._kafka_timeout_s if deadline is None else seconds_left(deadline)
        self._kafka(lambda: producer.commit_transaction(timeout))
        self._step(Step.KAFKA_COMMITTED)
        self._republished += len(rows)
        logger.warning("%s: re-published %d retained records of %s as %s", self._tid, len(rows), state, new_state)
        return len(rows), str(new_state), token

    def _missing_table_error(self) -> MissingTableError | None:
        """After a database error: the error naming a missing state or outbox table, if one is missing."""
        tables = [self._table] + ([self._outbox] if self._retain and self._outbox is not None else [])
        try:
            with self._engine.connect() as conn:
                inspector = sa.inspect(conn)
                missing = [t for t in tables if not inspector.has_table(t.name, schema=t.schema)]
        except sa.exc.SQLAlchemyError:
            return None
        if not missing:
            return None
        names = ", ".join(t.fullname for t in missing)
        return MissingTableError(
            f"{self._tid!r}: the table {names} does not exist in "
            f"{self._engine.url.render_as_string(hide_password=True)}. "
            "Create it once with the application's tables: define_state_table(metadata)"
            f"{' and define_outbox_table(metadata)' if self._retain else ''} on your MetaData, then "
            "metadata.create_all(engine) (or an Alembic migration); writer.create_tables() does it for scripts"
        )
