"""What every store is: :class:`StateStore`, what a claim returns, and the lock-timeout translation."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa

from .._values import StateRowLockedError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Claimed", "StateStore", "TakenOver", "locked"]


class TakenOver(Exception):
    """The state row no longer carries the caller's token: another instance claimed the id."""


@dataclass(frozen=True)
class Claimed:
    """What a claim found: the stored state (``None``: empty) and the row's new token."""

    state: str | None
    token: str


def _utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


class StateStore(Protocol):
    """How one database family locks, versions and writes a state row.  All methods run in the
    caller's database transaction on ``conn``; none commits (except :meth:`store_and_commit`)."""

    table: sa.Table
    optimistic: bool
    """True when :meth:`enter` locks nothing (the check happens in :meth:`store`)."""
    combined_commit: bool
    """True when :meth:`store_and_commit` can send the state update and the COMMIT in one round trip."""

    def claim(self, conn: sa.Connection, tid: str, *, lock_timeout_s: float | None) -> Claimed:
        """Lock the row (creating it if missing), read its state and give it a new version."""

    def touch(self, conn: sa.Connection, tid: str, token: str, *, lock_timeout_s: float | None) -> str:
        """Lock the row iff it still carries ``token`` and give it a new version; raise :class:`TakenOver`."""

    def enter(self, conn: sa.Connection, tid: str, token: str, *, lock_timeout_s: float | None) -> str:
        """Start a writer's transaction: check ``token`` (and lock the row) unless :attr:`optimistic`."""

    def store(self, conn: sa.Connection, tid: str, state: str | None, token: str, last: str | None) -> str:
        """Write ``state`` iff the row still carries ``token`` (and ``last``); return the new token."""

    def store_and_commit(self, conn: sa.Connection, tid: str, state: str, token: str, last: str | None) -> str:
        """:meth:`store` and COMMIT in one round trip (only if :attr:`combined_commit`)."""

    def read_settled(self, conn: sa.Connection, tid: str, *, lock_timeout_s: float) -> str | None:
        """The stored state, read after any unfinished transaction on the row ended."""

    def version(self, conn: sa.Connection, tid: str) -> str | None:
        """The row's current token, without locking (``None``: no row)."""

    def is_lock_error(self, exc: sa.exc.DBAPIError) -> bool:
        """True when ``exc`` means the row (or database) lock could not be had in time."""


def locked(store: StateStore, tid: str, action: str, call: Callable[[], Any]) -> Any:
    """Run ``call``; turn the database's lock-timeout error into :class:`StateRowLockedError`."""
    try:
        return call()
    except sa.exc.DBAPIError as exc:
        if store.is_lock_error(exc):
            raise StateRowLockedError.wrap(exc, tid, action) from exc
        raise
