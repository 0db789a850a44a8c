"""The writer's life cycle: an explicit state and the one gate every change of it goes through."""

from __future__ import annotations

import enum
from typing import Final

from kafka2pc import IllegalStateError

__all__ = ["PoolState", "WriterState", "check_transition"]


class WriterState(str, enum.Enum):
    """Where a :class:`DualWriter` is in its life cycle."""

    NEW = "new"
    """Created; the first transaction (or :meth:`DualWriter.recover`) recovers first."""
    RECOVERING = "recovering"
    READY = "ready"
    """Owns the transactional id: holds a producer and the state row's current token."""
    IN_TRANSACTION = "in_transaction"
    NEEDS_RECOVERY = "needs_recovery"
    """A failure left the outcome (or the row's token) open: the next transaction recovers first."""
    FENCED = "fenced"
    """Another instance took over the id; only an explicit :meth:`DualWriter.recover` takes it back."""
    CLOSED = "closed"


class PoolState(str, enum.Enum):
    """Where a :class:`WriterPool` is in its life cycle."""

    NEW = "new"
    """Made, not started (``start=False``, or an asyncio pool before its first transaction)."""
    STARTING = "starting"
    """One caller records the pool's ids; the others wait for it."""
    RUNNING = "running"
    """Renewing its leases and scanning for orphans in the background."""
    CLOSED = "closed"


_S = WriterState
TRANSITIONS: Final[dict[WriterState, frozenset[WriterState]]] = {
    _S.NEW: frozenset({_S.RECOVERING, _S.CLOSED}),
    _S.RECOVERING: frozenset({_S.READY, _S.NEEDS_RECOVERY, _S.FENCED}),
    _S.READY: frozenset({_S.IN_TRANSACTION, _S.RECOVERING, _S.CLOSED}),
    # A failed Kafka commit is settled by an inline recovery, still inside the transaction;
    # CLOSED: the transaction was interrupted (an exception from on_step, say) and the writer closed.
    _S.IN_TRANSACTION: frozenset({_S.READY, _S.NEEDS_RECOVERY, _S.FENCED, _S.RECOVERING, _S.CLOSED}),
    # FENCED: an unknown COMMIT outcome whose Kafka side turns out to be settled by another instance.
    _S.NEEDS_RECOVERY: frozenset({_S.RECOVERING, _S.FENCED, _S.CLOSED}),
    _S.FENCED: frozenset({_S.RECOVERING, _S.CLOSED}),
    _S.CLOSED: frozenset({_S.RECOVERING, _S.CLOSED}),
}
"""Allowed changes: ``TRANSITIONS[from]`` holds every state reachable in one step."""


def check_transition(transactional_id: str, current: WriterState, target: WriterState) -> None:
    """Raise :class:`~kafka2pc.IllegalStateError` unless ``current -> target`` is in :data:`TRANSITIONS`."""
    if target not in TRANSITIONS[current]:
        raise IllegalStateError(f"{transactional_id!r}: writer state {current.value} cannot become {target.value}")
