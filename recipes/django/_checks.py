"""The system check of the ``KAFKA2PC`` setting (``manage.py check``; no database, no broker)."""

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
