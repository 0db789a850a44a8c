"""``recover()``: at a worker's start, settle what dead workers left, and make the pool ready."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from django.db import DEFAULT_DB_ALIAS

from kafka2pc import UsageError

from ..dual_write import RecoveryResult
from ._runtime import runtime_for

__all__ = ["recover"]

logger = logging.getLogger("kafka2pc.recipes.django")


def recover(using: str | Iterable[str] | None = None, *, wait_s: float = 0.0) -> list[RecoveryResult]:
    """Start this process's pool of each alias and settle the ids whose lease expired; what each recovery found.

    Call it at worker start (gunicorn's ``post_worker_init``; with uvicorn or
    daphne, in the ASGI module: ``docs/django.md``), not in ``AppConfig.ready()``.  ``using`` is an alias or
    several (default ``"default"``).  The pool also settles expired leases
    by itself in the background while the process runs, so a worker killed
    while its transactions were open holds ``read_committed`` consumers
    back for at most about the lease (``POOL_OPTIONS["lease_s"]``, 15 s)
    plus a scan interval and the recovery.

    ``wait_s`` > 0 also waits, up to that long, for the ids other instances
    still hold to be released or to expire, settling each as it expires:
    for a deploy hook or a restart after every worker was stopped (a live
    worker renews its leases, and is left alone).  Returns every id settled
    (a :class:`~kafka2pc.recipes.dual_write.RecoveryResult` each: check
    ``result.ok``; a heuristic outcome is reported in it, not raised).
    Bounds: the settling of each id is bounded by the pool's Kafka and lock
    timeouts; the whole call by ``wait_s`` plus one settling round.
    """
    if wait_s < 0:
        raise UsageError("wait_s must not be negative")
    aliases = [using or DEFAULT_DB_ALIAS] if using is None or isinstance(using, str) else list(using)
    found: list[RecoveryResult] = []
    for alias in aliases:
        # Settled here before the pool's own orphan scan starts, so this call reports what it settled.
        pool = runtime_for(alias, start=False).pool
        deadline = time.monotonic() + wait_s
        try:
            while True:
                found.extend(pool.settle_orphans())
                held = [lease for lease in pool.leases() if lease.owner is not None and lease.owner != pool.owner]
                if not held or time.monotonic() >= deadline:
                    break
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        finally:
            pool.start()
        for result in found:
            if not result.ok:
                logger.error("kafka2pc: recovery of %r on %r: %s", result.transactional_id, alias,
                             result.error or "heuristic outcome")
    return found
