"""Recovery: what to do with an in-doubt Kafka transaction, and doing it (the sync driver).

The decisions are pure policy in :mod:`kafka2pc._recovery_policy`: generators
that yield requests (describe the transaction, describe the producers on the
anchor partition, probe a record's outcome, EndTxn, sleep, read the clock)
and return a :class:`RecoveryPlan` or a :class:`Settlement`.  This module is
their synchronous driver: :func:`run` answers each request with a
:class:`~kafka2pc._control.ControlPlane`, ``time.sleep`` and
``time.monotonic``, and throws errors back into the policy where it asked.
An asyncio driver would answer the same requests with ``await``.

:func:`plan` decides without changing anything; :func:`settle` carries the
plan out with EndTxn; :func:`outcome_of` probes what became of one stored
transaction.  All work from any process: no producer is needed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from kafka2pc._control import ControlPlane
from kafka2pc._recovery_policy import (
    LSO_WAIT_S,
    Clock,
    Decision,
    DescribeProducers,
    DescribeTransaction,
    EndTxn,
    ListTopics,
    Policy,
    RecordOutcome,
    RecoveryPlan,
    Request,
    Settlement,
    Sleep,
    TransactionOutcome,
    await_completed,
    plan_policy,
    resolve_outcomes,
    settle_policy,
    stored_outcome,
)
from kafka2pc._state import PreparedTxnState

__all__ = [
    "Decision",
    "RecoveryPlan",
    "Settlement",
    "TransactionOutcome",
    "outcome_of",
    "outcomes_of_settled",
    "plan",
    "run",
    "settle",
    "wait_for_markers",
]

_T = TypeVar("_T")


def _perform(ctrl: ControlPlane, request: Request) -> Any:
    """Answer one policy request with real I/O."""
    if isinstance(request, Clock):
        return time.monotonic()
    if isinstance(request, Sleep):
        # Never past the caller's deadline (a ``ControlPlane.deadline`` block): the
        # next request then raises BrokerUnavailableError in time.
        with ctrl.deadline(None) as deadline:
            time.sleep(min(request.seconds, deadline.remaining()))
        return None
    if isinstance(request, DescribeTransaction):
        return ctrl.describe_transaction(request.transactional_id)
    if isinstance(request, DescribeProducers):
        return ctrl.describe_producers(request.partition)
    if isinstance(request, ListTopics):
        return ctrl.topic_names()
    if isinstance(request, RecordOutcome):
        return ctrl.record_outcome(request.partition, request.offset)
    if isinstance(request, EndTxn):
        ctrl.end_txn(request.transactional_id, request.producer_id, request.producer_epoch, commit=request.commit)
        return None
    raise TypeError(f"unknown recovery request {request!r}")  # pragma: no cover - Request is closed


def run(ctrl: ControlPlane, policy: Policy[_T]) -> _T:
    """Drive ``policy`` to its result: answer its requests with ``ctrl``; throw errors into it."""
    answer: Any = None
    error: Exception | None = None
    try:
        while True:
            try:
                request = policy.throw(error) if error is not None else policy.send(answer)
            except StopIteration as stop:
                result: _T = stop.value
                return result
            answer, error = None, None
            try:
                answer = _perform(ctrl, request)
            except Exception as exc:  # noqa: BLE001 - handed to the policy, which handles or re-raises it at its yield
                error = exc
    finally:
        policy.close()


def outcome_of(ctrl: ControlPlane, state: PreparedTxnState) -> TransactionOutcome:
    """What became of the transaction ``state`` names (a read-only probe of its anchor record)."""
    return run(ctrl, stored_outcome(state))


def outcomes_of_settled(
    ctrl: ControlPlane, states: Mapping[str, PreparedTxnState], *, wait_s: float
) -> dict[str, TransactionOutcome]:
    """The outcomes of settled transactions, asked again while unknown for up to ``wait_s`` (see
    :func:`~kafka2pc._recovery_policy.resolve_outcomes`)."""
    return run(ctrl, resolve_outcomes(states, wait_s))


def wait_for_markers(ctrl: ControlPlane, transactional_ids: Sequence[str], timeout_s: float) -> list[str]:
    """Wait until the markers of the transactions just ended are written; the ids still not done."""
    return run(ctrl, await_completed(transactional_ids, timeout_s))


def plan(
    ctrl: ControlPlane, transactional_id: str, state: PreparedTxnState, *, settle_timeout_s: float = 30.0,
    lso_wait_s: float = LSO_WAIT_S,
) -> RecoveryPlan:
    """Decide what recovery would do for ``transactional_id`` given the stored ``state``; change nothing.

    ``settle_timeout_s`` bounds the wait for the coordinator to leave
    PrepareCommit/PrepareAbort; ``lso_wait_s`` the wait for a decided
    transaction's marker to reach its anchor's partition.  When another
    producer's open transaction holds the last stable offset back, the stored
    transaction's outcome is reported as ``unknown`` at once.
    """
    return run(ctrl, plan_policy(transactional_id, state, settle_timeout_s=settle_timeout_s, lso_wait_s=lso_wait_s))


def settle(
    ctrl: ControlPlane,
    transactional_id: str,
    state: PreparedTxnState,
    *,
    raise_on_heuristic: bool = True,
    indefinite_retries: int = 5,
    lso_wait_s: float = LSO_WAIT_S,
) -> Settlement:
    """Carry out :func:`plan`: commit the prepared transaction, or abort a stray one.

    Idempotent: settling again finds nothing open and reports the same outcome.
    Raises :class:`HeuristicOutcomeError` when Kafka aborted the stored
    transaction (unless ``raise_on_heuristic=False``).  An EndTxn without an
    answer is re-planned and retried up to ``indefinite_retries`` times, then
    raises :class:`IndefiniteOutcomeError`.  ``lso_wait_s`` as for :func:`plan`.
    """
    return run(
        ctrl,
        settle_policy(
            transactional_id, state, raise_on_heuristic=raise_on_heuristic, indefinite_retries=indefinite_retries,
            lso_wait_s=lso_wait_s,
        ),
    )
