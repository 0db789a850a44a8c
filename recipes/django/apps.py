"""The app's configuration: no side effects at start-up (nothing connects, nothing is queried)."""

from __future__ import annotations

from django.apps import AppConfig


class Kafka2pcConfig(AppConfig):
    """``kafka2pc.recipes.django``: the state and lease tables, their admin page and ``kafka2pc_recover``.

    ``ready()`` only registers the system check of the ``KAFKA2PC`` setting:
    the pool is made at the first ``dual_write()`` or ``recover()`` of each
    worker process, never at import.
    """

    name = "kafka2pc.recipes.django"
    label = "kafka2pc"
    verbose_name = "Kafka two-phase commit"
    default_auto_field = "django.db.models.AutoField"

    def ready(self) -> None:
        from django.core import checks

        from ._checks import check_settings

        checks.register(check_settings)
