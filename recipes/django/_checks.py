"""The system checks of the ``KAFKA2PC`` setting and of ``DATABASES`` (``manage.py check``; no database, no broker).

========  ==============================================================
id        what
========  ==============================================================
E001      ``settings.KAFKA2PC`` is missing or wrong
W001      an alias has ``ATOMIC_REQUESTS`` on: ``dual_write()`` in its views
          raises ``NestedAtomicError`` unless they are decorated with
          ``@transaction.non_atomic_requests``
========  ==============================================================
"""

from __future__ import annotations

from typing import Any

from django.core import checks

from ._settings import ConfigurationError, current_settings


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """One error naming what is wrong with ``settings.KAFKA2PC``, or nothing."""
    try:
        current_settings()
    except ConfigurationError as exc:
        return [checks.Error(str(exc), hint="See docs/django.md, 'Configure'", id="kafka2pc.E001")]
    return []


def check_atomic_requests(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """A warning per database alias with ``ATOMIC_REQUESTS`` on (its views run inside ``transaction.atomic``)."""
    from django.conf import settings

    return [
        checks.Warning(
            f"DATABASES[{alias!r}]['ATOMIC_REQUESTS'] is on: every view runs inside transaction.atomic, and "
            "dual_write() there raises NestedAtomicError",
            hint="Decorate each view that calls dual_write() with @transaction.non_atomic_requests (or "
                 f"non_atomic_requests(using={alias!r})), then silence kafka2pc.W001; see docs/django.md, "
                 "'Views that already run in a transaction'",
            id="kafka2pc.W001",
        )
        for alias, database in sorted(getattr(settings, "DATABASES", {}).items())
        if database.get("ATOMIC_REQUESTS")
    ]
