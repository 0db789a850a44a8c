"""The bounds of the producer's blocking calls: a default ``timeout``, and a deadline shared by each call's steps."""

from __future__ import annotations

import time

from kafka2pc._exceptions import BrokerUnavailableError, UsageError

__all__ = ["DEFAULT_CLOSE_TIMEOUT_S", "DEFAULT_TIMEOUT_S", "TIMEOUT_SLACK_S", "deadline_after", "time_left"]

DEFAULT_TIMEOUT_S = 60.0
"""The bound of ``init_transactions``, ``prepare_transaction``, ``commit_transaction``,
``abort_transaction`` and ``complete_transaction`` when the caller gives no ``timeout``.

The Java producer bounds the same calls by ``max.block.ms`` (60 s by default).
Without it librdkafka would wait until the broker returns, bounded only by
``transaction.timeout.ms`` (which kafka2pc raises to the broker's maximum, up
to about 35 minutes), holding the caller's database transaction all that time.
A call given ``timeout`` ends within it plus :data:`TIMEOUT_SLACK_S`.
"""
DEFAULT_CLOSE_TIMEOUT_S = 30.0
"""The bound of every ``close()`` given no ``timeout`` (producer, writers, pools, admin): what closing may
spend asking the coordinator about a transaction an abort left in doubt, or draining background commits."""
TIMEOUT_SLACK_S = 1.0
"""What a bounded call may overrun its ``timeout`` by: the request or poll in
flight when the deadline passes (librdkafka and kafka-python check their
deadlines between polls of at most a few hundred milliseconds)."""


def deadline_after(timeout: float | None) -> float:
    """The :func:`time.monotonic` deadline of a call given ``timeout`` (``None``: :data:`DEFAULT_TIMEOUT_S`)."""
    if timeout is not None and timeout < 0:
        raise UsageError(f"timeout must not be negative, got {timeout}")
    return time.monotonic() + (DEFAULT_TIMEOUT_S if timeout is None else timeout)


def time_left(deadline: float, op: str) -> float:
    """Seconds left before ``deadline``; :class:`BrokerUnavailableError` once it has passed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise BrokerUnavailableError(f"{op}: no answer from the cluster within the timeout")
    return remaining
