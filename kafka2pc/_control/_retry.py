"""One retry routine for control-plane requests, keyed by where the request goes.

A request goes to the transaction coordinator of a transactional id, to
the leader of a partition, or to any live broker (:class:`Route`).  Each route has the wire
errors that mean "ask where to send it again" (the coordinator or leader
moved) and those that mean "same place, a moment later" (it is busy), as the
Java ``TransactionManager`` handlers classify them.  :func:`call_with_retries`
is the loop: resolve the route, make the attempt, back off, stop at the
retry limit or the caller's deadline, whichever comes first.

The routine does no I/O of its own: the resolver, the attempt and the sleep
are passed in, so a sync driver on kafka-python's IO thread and an asyncio
driver can share it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from kafka2pc._errors import (
    WireError,
    error_name_for_code,
    translate_kafka_python_error,
)
from kafka2pc._exceptions import BrokerUnavailableError, Kafka2pcError

__all__ = ["Deadline", "Retry", "Route", "call_with_retries", "check_code"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class Route(enum.Enum):
    """Where a control-plane request goes."""

    COORDINATOR = "transaction coordinator"
    LEADER = "partition leader"
    ANY_BROKER = "any broker"


# The route's target moved: find it again before the next attempt.
_MOVED = {
    Route.COORDINATOR: frozenset({WireError.NOT_COORDINATOR, WireError.COORDINATOR_NOT_AVAILABLE}),
    Route.LEADER: frozenset(
        {WireError.NOT_LEADER_OR_FOLLOWER, WireError.LEADER_NOT_AVAILABLE, WireError.UNKNOWN_TOPIC_OR_PARTITION}
    ),
    Route.ANY_BROKER: frozenset({WireError.BROKER_NOT_AVAILABLE}),
}
# The target is busy: same target, a moment later.
_BUSY = {
    Route.COORDINATOR: frozenset({WireError.COORDINATOR_LOAD_IN_PROGRESS, WireError.CONCURRENT_TRANSACTIONS}),
    Route.LEADER: frozenset({WireError.OFFSET_NOT_AVAILABLE}),
    Route.ANY_BROKER: frozenset(),
}
# What a lost connection to the target counts as.
_CONNECTION_LOST = {
    Route.COORDINATOR: WireError.COORDINATOR_NOT_AVAILABLE,
    Route.LEADER: WireError.NOT_LEADER_OR_FOLLOWER,
    Route.ANY_BROKER: WireError.BROKER_NOT_AVAILABLE,
}
_BACKOFF_BASE_S = 0.05
_BACKOFF_MAX_S = 2.0


class Retry(Exception):
    """The attempt failed with a retriable wire error (raised inside attempts, caught by the loop)."""

    def __init__(self, code: int, *, re_resolve: bool = False) -> None:
        super().__init__(code)
        self.code = code
        self.re_resolve = re_resolve


@dataclass(frozen=True)
class Deadline:
    """A point in ``time.monotonic()`` time by which a call must finish, and why."""

    at: float
    timeout_s: float

    @classmethod
    def after(cls, timeout_s: float) -> Deadline:
        """The deadline ``timeout_s`` seconds from now."""
        return cls(time.monotonic() + timeout_s, timeout_s)

    def remaining(self) -> float:
        """Seconds left (never negative)."""
        return max(0.0, self.at - time.monotonic())

    def remaining_ms(self, cap_ms: int) -> int:
        """Milliseconds left, at most ``cap_ms`` (for one request's timeout)."""
        return int(min(cap_ms, self.remaining() * 1000))

    def expired(self) -> bool:
        """True once the deadline has passed."""
        return time.monotonic() >= self.at

    def earlier(self, other: Deadline | None) -> Deadline:
        """The earlier of ``self`` and ``other``."""
        return self if other is None or self.at <= other.at else other

    def exceeded(self, context: str, detail: str = "") -> BrokerUnavailableError:
        """The error for a call that did not finish in time."""
        suffix = f" ({detail})" if detail else ""
        return BrokerUnavailableError(
            f"{context}: did not finish within the {self.timeout_s:g} s timeout{suffix}",
            error_name="REQUEST_TIMED_OUT",
            error_code=int(WireError.REQUEST_TIMED_OUT),
        )


def check_code(route: Route, code: int, context: str, *, needs: str | None = None) -> None:
    """Return for success; raise :class:`Retry` for the route's retriable errors, a kafka2pc error otherwise.

    ``needs``: the ACL the request needs, named in an authorization error.
    """
    if code == WireError.NONE:
        return
    if code in _MOVED[route]:
        raise Retry(code, re_resolve=True)
    if code in _BUSY[route]:
        raise Retry(code)
    raise translate_kafka_python_error(code, context, needs=needs)


def backoff_s(attempt: int) -> float:
    """Exponential backoff before retry number ``attempt + 1`` (50 ms doubling, capped at 2 s)."""
    return float(min(_BACKOFF_BASE_S * (2**attempt), _BACKOFF_MAX_S))


async def call_with_retries(
    route: Route,
    context: str,
    resolve: Callable[[bool], Awaitable[int]],
    attempt_fn: Callable[[int], Awaitable[_T]],
    *,
    max_retries: int,
    deadline: Deadline,
    sleep: Callable[[float], Awaitable[None]],
    connection_errors: tuple[type[BaseException], ...],
) -> _T:
    """``attempt_fn(node)`` with ``node = await resolve(re_resolve)``, retried by the route's rules.

    ``resolve(True)`` must look the target up afresh (after it moved or its
    connection was lost); it may itself raise :class:`Retry`.  Errors that
    are not retriable propagate at once.  When retries or time run out, the
    last wire error is raised as a kafka2pc error (a :class:`BrokerUnavailableError`
    when time ran out) naming the attempts made.
    """
    re_resolve = False
    last_code: int = WireError.NONE
    attempts = max_retries + 1
    made = 0
    for attempt in range(attempts):
        if deadline.expired():
            break
        made += 1
        try:
            node = await resolve(re_resolve)
            return await attempt_fn(node)
        except Kafka2pcError:
            raise
        except Retry as retry:
            last_code, re_resolve = retry.code, retry.re_resolve
            reason = error_name_for_code(retry.code)
        except connection_errors as exc:
            last_code, re_resolve = _CONNECTION_LOST[route], True
            reason = f"{type(exc).__name__}: {exc}"
        if attempt + 1 < attempts:
            pause = min(backoff_s(attempt), deadline.remaining())
            log.info("%s: %s (attempt %d of %d), retrying in %.2f s", context, reason, attempt + 1, attempts, pause)
            await sleep(pause)
    tried = f"{made} attempt{'' if made == 1 else 's'}"
    if deadline.expired():
        detail = f"{tried}; last error {error_name_for_code(last_code)}" if last_code else tried
        raise deadline.exceeded(context, detail)
    raise translate_kafka_python_error(last_code, f"{context}: gave up after {tried}")
