"""Ending and fencing transactions at the coordinator: EndTxn and InitProducerId.

:class:`Completion` is a collaborator of :class:`~kafka2pc._control.ControlPlane`:
it holds the plane's :class:`~kafka2pc._control._session.Session` (the
connection) and owns nothing else; the plane's ``end_txn``,
``init_producer_id`` and ``fence`` are its methods.
"""

from __future__ import annotations

import logging

import kafka.errors as kafka_errors
from kafka.admin import KafkaAdminClient

from kafka2pc._control import _protocol as protocol
from kafka2pc._control._retry import Deadline, Retry, Route, check_code
from kafka2pc._control._session import (
    Session,
    on_txn_id,
)
from kafka2pc._errors import WireError, translate_kafka_python_error
from kafka2pc._exceptions import (
    HeuristicOutcomeError,
    IndefiniteOutcomeError,
    UnsupportedBrokerError,
)
from kafka2pc._types import (
    InitProducerIdResult,
    TransactionDescription,
)

log = logging.getLogger("kafka2pc._control._plane")

DEFAULT_FENCE_TRANSACTION_TIMEOUT_MS = 60_000
"""``transaction.timeout.ms`` sent with a fencing InitProducerId when the coordinator reports none."""

_OPPOSITE_OUTCOME_STATES = {
    True: ("PrepareAbort", "CompleteAbort", "aborted"),
    False: ("PrepareCommit", "CompleteCommit", "committed"),
}


def fence_transaction_timeout_ms(description: TransactionDescription | None) -> int:
    """The ``transaction_timeout_ms`` for an InitProducerId that fences ``description``'s producer.

    The coordinator's own value when it reports one; otherwise (unknown id,
    or a coordinator answering ``-1``/``0``) :data:`DEFAULT_FENCE_TRANSACTION_TIMEOUT_MS`.
    """
    if description is not None and description.timeout_ms > 0:
        return description.timeout_ms
    return DEFAULT_FENCE_TRANSACTION_TIMEOUT_MS


class _InvalidTxnState(Exception):
    """Internal: EndTxn answered INVALID_TXN_STATE (explained outside the retry loop)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Completion:
    """EndTxn (commit, abort, KIP-939's prepared states) and InitProducerId (a new epoch, fencing)."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def end_txn(
        self,
        transactional_id: str,
        producer_id: int,
        producer_epoch: int,
        *,
        commit: bool,
        timeout: float | None = None,
    ) -> None:
        """Commit or abort the transaction open under ``{producer_id, epoch}``.

        This is how a prepared transaction of a crashed producer is completed
        (the approach of Flink's ``resumeTransaction``): EndTxn straight to the
        coordinator with the stored ids.  The caller must first check that the
        open transaction *is* the prepared one (DescribeTransactions +
        DescribeProducers anchor): with librdkafka (transaction version 1)
        consecutive transactions share ``{producer_id, epoch}``, and EndTxn
        completes whichever one is open.

        Version: at most EndTxn v4.  Against 4.3.1, v5 on a TV1 transaction
        commits it but bumps the epoch (TV2 semantics), after which a retry
        with the stored epoch is answered PRODUCER_FENCED; v3/v4 complete it
        and keep the epoch, which is what the stored prepared state names.

        Outcomes (observed on 4.3.1):

        * repeating the *same* decision after it completed is answered with
          success by the coordinator, so a retry is harmless and returns;
        * the opposite decision after completion is INVALID_TXN_STATE (or
          CONCURRENT_TRANSACTIONS while markers are written, retried here);
          if the coordinator then reports the same ids settled the other way
          this raises :class:`HeuristicOutcomeError` (``outcome`` says which);
        * a different epoch: PRODUCER_FENCED -> :class:`ProducerFencedError`
          (also what a transaction aborted by its timeout looks like: the
          coordinator bumped the epoch); a different producer id:
          INVALID_PRODUCER_ID_MAPPING -> :class:`ProducerFencedError`;
        * no answer in time, or the connection dropped with the request in
          flight: :class:`IndefiniteOutcomeError` -- it may or may not have
          been applied; ask :meth:`describe_transaction`/:meth:`record_outcome`.

        Retried with backoff (at most ``max_retries``, within the deadline):
        NOT_COORDINATOR and COORDINATOR_NOT_AVAILABLE (after finding the
        coordinator again), COORDINATOR_LOAD_IN_PROGRESS and CONCURRENT_TRANSACTIONS.
        """
        decision = "commit" if commit else "abort"
        decided = "committed" if commit else "aborted"
        context = f"EndTxn({decision}) for {transactional_id!r} producer_id={producer_id} epoch={producer_epoch}"
        deadline = self._session.call_deadline(timeout)

        async def attempt(admin: KafkaAdminClient, coordinator: int) -> None:
            request = protocol.end_txn(transactional_id, producer_id, producer_epoch, commit=commit)
            try:
                response = await self._session.send(admin, request, coordinator, deadline, context)
            except kafka_errors.NodeNotReadyError:
                raise Retry(WireError.COORDINATOR_NOT_AVAILABLE, re_resolve=True) from None  # never sent
            except kafka_errors.IncompatibleBrokerVersion:
                raise
            except kafka_errors.KafkaError as exc:
                raise IndefiniteOutcomeError(
                    f"{context}: no answer ({exc}); the transaction may or may not be {decided}",
                    state=(producer_id, producer_epoch),
                ) from exc
            code = int(response.error_code)
            if code == WireError.NONE:
                log.info("%s: done (EndTxn v%s)", context, request.API_VERSION)
                return
            if code == WireError.INVALID_TXN_STATE:
                raise _InvalidTxnState(code)
            check_code(Route.COORDINATOR, code, context, needs=on_txn_id("WRITE", transactional_id))

        async def go(admin: KafkaAdminClient, coordinator: int) -> None:
            try:
                await attempt(admin, coordinator)
            except _InvalidTxnState as invalid_state:
                await self._explain_invalid_txn_state(
                    admin, transactional_id, producer_id, producer_epoch, commit, invalid_state.code, context,
                    deadline,
                )

        self._session.on_coordinator(transactional_id, context, deadline, go)

    async def _explain_invalid_txn_state(
        self,
        admin: KafkaAdminClient,
        transactional_id: str,
        producer_id: int,
        producer_epoch: int,
        commit: bool,
        code: int,
        context: str,
        deadline: Deadline,
    ) -> None:
        """INVALID_TXN_STATE from EndTxn: was it settled the other way?"""
        prepare_state, complete_state, outcome = _OPPOSITE_OUTCOME_STATES[commit]
        coordinator = await self._session.coordinator(admin, transactional_id, False, deadline)
        response = await self._session.send(
            admin, protocol.describe_transactions(transactional_id), coordinator, deadline, context
        )
        for txn in response.transaction_states:
            if (
                txn.error_code == WireError.NONE
                and txn.producer_id == producer_id
                and txn.producer_epoch == producer_epoch
                and txn.transaction_state in (prepare_state, complete_state)
            ):
                raise HeuristicOutcomeError(
                    f"{context}: the coordinator already {outcome} the transaction "
                    f"(state {txn.transaction_state})",
                    transactional_id=transactional_id,
                    state=(producer_id, producer_epoch),
                    outcome=outcome,
                    error_name="INVALID_TXN_STATE",
                    error_code=code,
                )
        raise translate_kafka_python_error(code, context)

    def init_producer_id(
        self,
        transactional_id: str,
        *,
        transaction_timeout_ms: int,
        keep_prepared_txn: bool = False,
        enable_2pc: bool = False,
        timeout: float | None = None,
    ) -> InitProducerIdResult:
        """InitProducerId for ``transactional_id`` (KIP-939 fields when asked).

        With ``keep_prepared_txn=False`` this is KIP-939's
        ``forceTerminateTransaction``: the coordinator aborts any open
        transaction and bumps the epoch, fencing every older instance.  (It
        first answers CONCURRENT_TRANSACTIONS while the abort markers are
        written; that is retried here.)

        ``keep_prepared_txn``/``enable_2pc`` need InitProducerId v6.  If the
        coordinator's broker does not advertise v6, nothing is sent and
        :class:`UnsupportedBrokerError` is raised.  If it does but the
        coordinator refuses (UNSUPPORTED_VERSION), the same error is raised.
        Observed on 4.3.1: v6 is not advertised (it is an unstable version;
        sending it anyway makes the broker close the connection, the request
        never reaches the coordinator).  With ``unstable.api.versions.enable``
        the coordinator answers ``KeepPreparedTxn=true`` with
        UNSUPPORTED_VERSION and the open transaction stays exactly as it was
        (state Ongoing, same producer id and epoch, same partitions, same
        CurrentTxnStartOffset).  ``Enable2Pc=true`` alone is accepted and, like
        any InitProducerId without ``KeepPreparedTxn``, aborts the open
        transaction.
        """
        wants_2pc = keep_prepared_txn or enable_2pc
        context = (
            f"InitProducerId for {transactional_id!r}"
            f" (keepPreparedTxn={keep_prepared_txn}, enable2Pc={enable_2pc})"
        )
        deadline = self._session.call_deadline(timeout)

        async def attempt(admin: KafkaAdminClient, coordinator: int) -> InitProducerIdResult:
            request = protocol.init_producer_id(
                transactional_id,
                transaction_timeout_ms=transaction_timeout_ms,
                keep_prepared_txn=keep_prepared_txn,
                enable_2pc=enable_2pc,
            )
            try:
                response = await self._session.send(admin, request, coordinator, deadline, context)
            except kafka_errors.IncompatibleBrokerVersion as exc:
                raise UnsupportedBrokerError(
                    f"{context}: the transaction coordinator (broker {coordinator}) does not "
                    "support InitProducerId v6 (KIP-939), so it cannot keep a prepared "
                    "transaction or enable 2PC; nothing was sent",
                    error_name=WireError.UNSUPPORTED_VERSION.name,
                    error_code=int(WireError.UNSUPPORTED_VERSION),
                ) from exc
            code = int(response.error_code)
            if wants_2pc and code == WireError.UNSUPPORTED_VERSION:
                raise UnsupportedBrokerError(
                    f"{context}: the transaction coordinator refused the KIP-939 request "
                    "(UNSUPPORTED_VERSION); the open transaction was left as it was",
                    error_name=WireError.UNSUPPORTED_VERSION.name,
                    error_code=code,
                )
            check_code(Route.COORDINATOR, code, context, needs=on_txn_id("WRITE", transactional_id))
            return InitProducerIdResult(
                producer_id=int(response.producer_id),
                producer_epoch=int(response.producer_epoch),
                ongoing_txn_producer_id=int(getattr(response, "ongoing_txn_producer_id", -1)),
                ongoing_txn_epoch=int(getattr(response, "ongoing_txn_producer_epoch", -1)),
            )

        result = self._session.on_coordinator(transactional_id, context, deadline, attempt)
        log.info("%s: producer_id=%d epoch=%d", context, result.producer_id, result.producer_epoch)
        return result

    def fence(
        self,
        transactional_id: str,
        description: TransactionDescription | None = None,
        *,
        timeout: float | None = None,
    ) -> InitProducerIdResult:
        """Abort whatever is open under ``transactional_id`` and bump its epoch (fences old instances).

        InitProducerId without KIP-939 fields, with the transaction timeout
        :func:`fence_transaction_timeout_ms` picks from ``description`` (the
        coordinator's view from just before, if the caller has one).
        """
        return self.init_producer_id(
            transactional_id, transaction_timeout_ms=fence_transaction_timeout_ms(description), timeout=timeout
        )
