"""The app's configuration: no side effects at start-up (nothing connects, nothing is queried)."""

from __future__ import annotations

from django.apps import AppConfig


class Kafka2pcConfig(AppConfig):
    """``kafka2pc.recipes.django``: the state and lease tables, their admin page and ``kafka2pc_recover``.

    ``ready()`` only registers the system checks and a ``setting_changed``
    receiver (``override_settings(KAFKA2PC=...)`` closes the pools, so the
    next ``dual_write()`` uses the new value): the pool is made at the first
    ``dual_write()`` or ``recover()`` of each worker process, never at import.
    """

    name = "kafka2pc.recipes.django"
    label = "kafka2pc"
    verbose_name = "Kafka two-phase commit"
    default_auto_field = "django.db.models.AutoField"

    def ready(self) -> None:
        from django.core import checks
        from django.core.signals import setting_changed

        from ._checks import check_atomic_requests, check_settings
        from ._runtime import on_setting_changed

        checks.register(check_settings)
        checks.register(check_atomic_requests)
        setting_changed.connect(on_setting_changed, dispatch_uid="kafka2pc.recipes.django.setting_changed")
