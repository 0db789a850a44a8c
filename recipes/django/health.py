"""A health check for orchestrators: can this worker's pool reach Kafka, and what does it hold?

::

    # urls.py
    from kafka2pc.recipes.django.health import pool_health

    urlpatterns += [path("health/kafka2pc", pool_health)]

``GET /health/kafka2pc`` (``?database=ALIAS``, default ``default``) answers
``200`` with ``{"ok": true, ...}`` when the transaction coordinator of the
pool's first id answers within :data:`HEALTH_TIMEOUT_S`, and ``503`` with
``{"ok": false, "kafka": "<why>"}`` otherwise: a Kubernetes readiness probe
then stops sending requests to a worker whose ``dual_write()`` would fail.
The answer also carries the pool's :class:`~kafka2pc.recipes.dual_write.PoolMetrics`
in this process (``null`` before its first ``dual_write()``), among them
``in_doubt_transactions`` and ``heuristic_outcomes``, which a person must look
at.  The check queries no database and makes no pool.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from django.http import HttpRequest, JsonResponse

__all__ = ["HEALTH_TIMEOUT_S", "pool_health"]

HEALTH_TIMEOUT_S = 5.0
"""Bound of the Kafka probe of one health check (seconds); the check answers within about this long."""


def pool_health(request: HttpRequest) -> JsonResponse:
    """The health of this process's pool of ``?database=ALIAS``: 200 if Kafka answers, 503 otherwise."""
    from django.db import DEFAULT_DB_ALIAS

    from kafka2pc import Kafka2pcError, TransactionAdmin

    from ._runtime import existing_runtime
    from ._settings import ConfigurationError, current_settings

    alias = request.GET.get("database") or DEFAULT_DB_ALIAS
    try:
        settings = current_settings()
    except ConfigurationError as exc:
        return JsonResponse({"ok": False, "database": alias, "kafka": f"configuration: {exc}"}, status=503)
    runtime = existing_runtime(alias)
    body: dict[str, Any] = {
        "database": alias,
        "pool": None if runtime is None else _plain(dataclasses.asdict(runtime.pool.metrics())),
    }
    try:
        with TransactionAdmin(settings.producer, timeout_s=HEALTH_TIMEOUT_S) as admin:
            admin.describe_transaction(f"{settings.prefix_for(alias)}-0", timeout=HEALTH_TIMEOUT_S)
    except Kafka2pcError as exc:
        return JsonResponse({"ok": False, "kafka": f"{type(exc).__name__}: {exc}", **body}, status=503)
    return JsonResponse({"ok": True, "kafka": "ok", **body})


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
