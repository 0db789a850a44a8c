"""The ``KAFKA2PC`` setting: one dict, read and checked in one place."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from kafka2pc import UsageError

__all__ = ["ConfigurationError", "Kafka2pcSettings", "read_settings"]

#: ``WriterPool`` keyword arguments the ``POOL_OPTIONS`` key may set (the others are the app's).
POOL_OPTIONS = frozenset({
    "max_slots", "lease_s", "scan_every_s", "acquire_timeout_s", "settle_parallelism", "retain_records",
    "lock_timeout_s", "kafka_timeout_s", "on_step", "owner",
})
_KEYS = frozenset({"PRODUCER", "TRANSACTIONAL_ID_PREFIX", "POOL_SIZE", "POOL_OPTIONS"})


class ConfigurationError(UsageError, ImproperlyConfigured):
    """The ``KAFKA2PC`` setting is missing or wrong (a :class:`~kafka2pc.UsageError` and Django's
    ``ImproperlyConfigured``)."""


@dataclass(frozen=True)
class Kafka2pcSettings:
    """The ``KAFKA2PC`` setting, checked.

    ``producer`` is the confluent-kafka configuration (``bootstrap.servers``
    and the like, no ``transactional.id``), ``prefix`` names the pool of
    transactional ids, ``pool_size`` is how many ids the pool has (all
    processes together), ``pool_options`` are further
    :class:`~kafka2pc.recipes.dual_write.WriterPool` keyword arguments.
    """

    producer: Mapping[str, Any]
    prefix: str
    pool_size: int
    pool_options: Mapping[str, Any] = field(default_factory=dict)

    def prefix_for(self, alias: str) -> str:
        """The pool's prefix for database ``alias``: ``prefix`` for ``default``, ``prefix.alias`` otherwise."""
        return self.prefix if alias == "default" else f"{self.prefix}.{alias}"


def read_settings(value: object) -> Kafka2pcSettings:
    """Check the ``KAFKA2PC`` setting's value; raise :class:`ConfigurationError` naming what is wrong."""
    if not isinstance(value, Mapping):
        raise ConfigurationError("settings.KAFKA2PC must be a dict with PRODUCER, TRANSACTIONAL_ID_PREFIX and "
                                 "POOL_SIZE (see docs/django.md)")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ConfigurationError(f"settings.KAFKA2PC has unknown keys {unknown}; known: {sorted(_KEYS)}")
    producer = value.get("PRODUCER")
    if not isinstance(producer, Mapping) or not producer.get("bootstrap.servers"):
        raise ConfigurationError("settings.KAFKA2PC['PRODUCER'] must be a confluent-kafka configuration dict "
                                 "with 'bootstrap.servers'")
    if "transactional.id" in producer:
        raise ConfigurationError("settings.KAFKA2PC['PRODUCER'] must not set 'transactional.id': the app leases "
                                 "its ids from the pool named by TRANSACTIONAL_ID_PREFIX")
    prefix = value.get("TRANSACTIONAL_ID_PREFIX")
    if not isinstance(prefix, str) or not prefix or len(prefix) > 200:
        raise ConfigurationError("settings.KAFKA2PC['TRANSACTIONAL_ID_PREFIX'] must be a non-empty string "
                                 "of at most 200 characters")
    size = value.get("POOL_SIZE", 8)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigurationError("settings.KAFKA2PC['POOL_SIZE'] must be a positive integer (the transactional "
                                 "ids of all processes together)")
    options = value.get("POOL_OPTIONS", {})
    if not isinstance(options, Mapping):
        raise ConfigurationError("settings.KAFKA2PC['POOL_OPTIONS'] must be a dict of WriterPool arguments")
    bad = sorted(set(options) - POOL_OPTIONS)
    if bad:
        raise ConfigurationError(f"settings.KAFKA2PC['POOL_OPTIONS'] has unknown keys {bad}; "
                                 f"known: {sorted(POOL_OPTIONS)}")
    return Kafka2pcSettings(dict(producer), prefix, size, dict(options))


def current_settings() -> Kafka2pcSettings:
    """``settings.KAFKA2PC``, checked."""
    from django.conf import settings

    return read_settings(getattr(settings, "KAFKA2PC", None))
