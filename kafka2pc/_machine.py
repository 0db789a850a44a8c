"""The client-side transaction state machine of :class:`TwoPhaseCommitProducer`.

One enum (:class:`TxnState`), one table of allowed transitions
(:data:`TRANSITIONS`, source -> allowed targets, the orientation of every
state table in kafka2pc; Kafka's Java ``TransactionManager.isTransitionValid``
holds the same pairs the other way round, as a switch on the target that
lists its allowed sources), one table of the states each public
operation may start from (:data:`OPERATIONS`), and one gate
(:class:`StateMachine`) that raises :class:`IllegalStateError` — never an
``assert`` — and remembers the cause of error states.

Compared with KIP-939:

=====================  ============================================================
KIP-939                kafka2pc
=====================  ============================================================
initTransactions(false) ``UNINITIALIZED -> READY`` (aborts any open transaction)
initTransactions(true)  ``UNINITIALIZED -> RECOVERING``: a previous instance's
                        transaction may be prepared; only commit / abort / complete
prepareTransaction()    ``IN_TRANSACTION -> PREPARED``; afterwards only commit /
                        abort / complete ("calling .send would fail")
completeTransaction(s)  from ``PREPARED``, ``RECOVERING`` or ``IN_DOUBT`` to ``READY``;
                        elsewhere INVALID_TXN_STATE (here: IllegalStateError)
(not in the KIP)        ``IN_DOUBT``: a commit/abort timed out; only the same call
                        or complete is allowed, so no new transaction starts before
                        the outcome is known (KAFKA-17754)
=====================  ============================================================

``FATAL_ERROR`` and ``CLOSED`` are terminal.
"""

from __future__ import annotations

import enum
import threading
from typing import Final

from kafka2pc._exceptions import IllegalStateError

__all__ = ["OPERATIONS", "TRANSITIONS", "StateMachine", "TxnState"]


class TxnState(enum.Enum):
    """Where a :class:`TwoPhaseCommitProducer` is in its transaction life cycle."""

    UNINITIALIZED = "uninitialized"
    READY = "ready"
    IN_TRANSACTION = "in_transaction"
    PREPARED = "prepared"
    RECOVERING = "recovering"
    IN_DOUBT = "in_doubt"
    ABORTABLE_ERROR = "abortable_error"
    FATAL_ERROR = "fatal_error"
    CLOSED = "closed"


_S = TxnState

#: source state -> the states it may move to in one step (every live state may turn fatal; close() from anywhere).
TRANSITIONS: Final[dict[TxnState, frozenset[TxnState]]] = {
    _S.UNINITIALIZED: frozenset({_S.READY, _S.RECOVERING, _S.FATAL_ERROR, _S.CLOSED}),
    _S.READY: frozenset({_S.IN_TRANSACTION, _S.FATAL_ERROR, _S.CLOSED}),
    _S.IN_TRANSACTION: frozenset(
        {_S.READY, _S.PREPARED, _S.IN_DOUBT, _S.ABORTABLE_ERROR, _S.FATAL_ERROR, _S.CLOSED}
    ),
    _S.PREPARED: frozenset({_S.READY, _S.IN_DOUBT, _S.ABORTABLE_ERROR, _S.FATAL_ERROR, _S.CLOSED}),
    _S.RECOVERING: frozenset({_S.READY, _S.IN_DOUBT, _S.FATAL_ERROR, _S.CLOSED}),
    _S.IN_DOUBT: frozenset({_S.READY, _S.IN_DOUBT, _S.FATAL_ERROR, _S.CLOSED}),
    _S.ABORTABLE_ERROR: frozenset({_S.READY, _S.IN_DOUBT, _S.ABORTABLE_ERROR, _S.FATAL_ERROR, _S.CLOSED}),
    _S.FATAL_ERROR: frozenset({_S.CLOSED}),
    _S.CLOSED: frozenset({_S.CLOSED}),
}

#: public operation -> states it may be called in.
OPERATIONS: Final[dict[str, frozenset[TxnState]]] = {
    "init_transactions": frozenset({_S.UNINITIALIZED}),
    "begin_transaction": frozenset({_S.READY}),
    "produce": frozenset({_S.IN_TRANSACTION}),
    "send_offsets_to_transaction": frozenset({_S.IN_TRANSACTION}),
    "prepare_transaction": frozenset({_S.IN_TRANSACTION}),
    "commit_transaction": frozenset({_S.IN_TRANSACTION, _S.PREPARED, _S.RECOVERING, _S.IN_DOUBT}),
    "abort_transaction": frozenset(
        {_S.IN_TRANSACTION, _S.PREPARED, _S.RECOVERING, _S.IN_DOUBT, _S.ABORTABLE_ERROR}
    ),
    "complete_transaction": frozenset({_S.PREPARED, _S.RECOVERING, _S.IN_DOUBT}),
}


class StateMachine:
    """The gate every state change and every public operation goes through (thread-safe)."""

    def __init__(self) -> None:
        self._state = TxnState.UNINITIALIZED
        self._cause: BaseException | None = None
        self._in_doubt_operation: str | None = None
        self._lock = threading.Lock()

    @property
    def state(self) -> TxnState:
        """The current state."""
        return self._state

    @property
    def cause(self) -> BaseException | None:
        """The error that put the machine into an error or in-doubt state."""
        return self._cause

    @property
    def in_doubt_operation(self) -> str | None:
        """In ``IN_DOUBT``: the operation (``commit_transaction``/``abort_transaction``) whose outcome is unknown."""
        return self._in_doubt_operation

    def check(self, operation: str) -> TxnState:
        """Raise :class:`IllegalStateError` unless ``operation`` may run now; return the state."""
        state = self._state
        if state not in OPERATIONS[operation]:
            raise IllegalStateError(self._refusal(operation, state))
        if state is TxnState.IN_DOUBT and operation not in ("complete_transaction", self._in_doubt_operation):
            raise IllegalStateError(
                f"{operation}() refused: the outcome of {self._in_doubt_operation}() is unknown; retry it or "
                f"call complete_transaction(state) first (cause: {self._cause!r})"
            )
        return state

    def transition_to(
        self, target: TxnState, *, cause: BaseException | None = None, operation: str | None = None
    ) -> None:
        """Move to ``target`` or raise :class:`IllegalStateError`; error states keep ``cause``."""
        with self._lock:
            source = self._state
            if target not in TRANSITIONS[source]:
                raise IllegalStateError(f"invalid transition {source.value} -> {target.value}")
            self._state = target
            if target in (TxnState.ABORTABLE_ERROR, TxnState.FATAL_ERROR, TxnState.IN_DOUBT):
                self._cause = cause
            elif target is not TxnState.CLOSED:
                self._cause = None
            self._in_doubt_operation = operation if target is TxnState.IN_DOUBT else None

    def _refusal(self, operation: str, state: TxnState) -> str:
        allowed = ", ".join(sorted(s.value for s in OPERATIONS[operation]))
        hint = {
            TxnState.PREPARED: "the transaction is prepared: only commit, abort or complete are allowed",
            TxnState.RECOVERING: (
                "init_transactions(keep_prepared_txn=True) kept a possibly prepared transaction: "
                "only commit, abort or complete are allowed"
            ),
            TxnState.FATAL_ERROR: f"the producer hit a fatal error ({self._cause!r}); create a new one",
            TxnState.ABORTABLE_ERROR: f"the transaction failed ({self._cause!r}); abort it",
            TxnState.IN_DOUBT: (
                f"the outcome of {self._in_doubt_operation}() is unknown; retry it or call "
                f"complete_transaction(state) first (cause: {self._cause!r})"
            ),
            TxnState.UNINITIALIZED: "call init_transactions() first",
            TxnState.CLOSED: "the producer is closed",
        }.get(state, f"allowed in: {allowed}")
        return f"{operation}() is not allowed in state {state.value}: {hint}"
