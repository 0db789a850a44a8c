"""The system checks of the ``KAFKA2PC`` setting (``manage.py check``; no database connection, no broker).

Each problem gets its own id:

* ``kafka2pc.E001``: the setting's shape (not a dict, an unknown key, ``PRODUCER``,
  ``TRANSACTIONAL_ID_PREFIX``, ``POOL_SIZE``, ``POOL_OPTIONS`` not a dict or with an unknown key);
* ``kafka2pc.E1nn``: a bad ``POOL_OPTIONS`` value (one id per option, :data:`OPTION_CHECK_IDS`), found by
  the same checks ``WriterPool`` and ``WriterOptions`` raise;
* ``kafka2pc.E002``: the ``default`` database's backend is not one the app supports (PostgreSQL, SQLite,
  MySQL/MariaDB); ``kafka2pc.W002``: another alias's is not (``dual_write(using=...)`` fails there);
* ``kafka2pc.W001``: an alias has ``ATOMIC_REQUESTS`` on: ``dual_write()`` in its views raises
  ``NestedAtomicError`` unless they are decorated with ``@transaction.non_atomic_requests``.
"""

from __future__ import annotations

from typing import Any

from django.core import checks

from ._settings import OPTION_CHECK_IDS, setting_problems

__all__ = ["OPTION_CHECK_IDS", "SUPPORTED_VENDORS", "check_atomic_requests", "check_settings"]

SUPPORTED_VENDORS = frozenset({"postgresql", "sqlite", "mysql"})
"""Django's ``connection.vendor`` of the backends the app runs on (``_engines.py`` maps each)."""

_HINT = "See docs/django.md, 'Configure'"


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Every problem of ``settings.KAFKA2PC`` and of the databases' backends, each with its own id."""
    from django.conf import settings

    found: list[checks.CheckMessage] = [
        checks.Error(problem.message, hint=_HINT, id=problem.id)
        for problem in setting_problems(getattr(settings, "KAFKA2PC", None))
    ]
    return found + _check_backends()


def _check_backends() -> list[checks.CheckMessage]:
    from django.db import connections

    found: list[checks.CheckMessage] = []
    for alias in connections:
        vendor = connections[alias].vendor  # the wrapper only: nothing is connected
        if vendor in SUPPORTED_VENDORS:
            continue
        message = (f"database {alias!r} uses Django's {vendor!r} backend: kafka2pc.recipes.django supports "
                   f"{', '.join(sorted(SUPPORTED_VENDORS))} only")
        if alias == "default":
            found.append(checks.Error(message, hint=_HINT, id="kafka2pc.E002"))
        else:
            found.append(checks.Warning(message + f"; dual_write(using={alias!r}) fails there", hint=_HINT,
                                        id="kafka2pc.W002"))
    return found


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
