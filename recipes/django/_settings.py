"""The ``KAFKA2PC`` setting: one dict, read and checked in one place."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final

from django.core.exceptions import ImproperlyConfigured

from kafka2pc import UsageError

from ..dual_write import WriterOptions
from ..dual_write._options import pool_option_problems
from ..dual_write._pool import PoolShape

__all__ = ["DEFAULT_KAFKA_TIMEOUT_S", "OPTION_CHECK_IDS", "ConfigurationError", "Kafka2pcSettings", "SettingProblem",
           "read_settings", "setting_problems"]

DEFAULT_KAFKA_TIMEOUT_S: Final = 30.0
"""The pool's ``kafka_timeout_s`` unless ``POOL_OPTIONS`` sets it: a request never waits on librdkafka's own,
longer limits."""

_WRITER_KEYS = frozenset(f.name for f in fields(WriterOptions))
_POOL_KEYS = frozenset(f.name for f in fields(PoolShape)) - {"prefix", "size"}

#: The keys ``POOL_OPTIONS`` may set: :class:`~kafka2pc.recipes.dual_write.WriterOptions`' fields and the
#: ``WriterPool`` arguments of its own (derived from both, never listed by hand).
POOL_OPTIONS = _WRITER_KEYS | _POOL_KEYS
_KEYS = frozenset({"PRODUCER", "TRANSACTIONAL_ID_PREFIX", "POOL_SIZE", "POOL_OPTIONS"})

#: The pipelined commit's keys.  Their check ids come after the others' (E113 on), so that the ids
#: of the other options, which a project may list in ``SILENCED_SYSTEM_CHECKS``, never move.
_PIPELINE_KEYS = frozenset({"pipelined", "max_in_flight", "slow_commit_s"}) & POOL_OPTIONS

#: The system check id of each ``POOL_OPTIONS`` value's problem (``kafka2pc.E001``: the setting's shape).
OPTION_CHECK_IDS: Final[dict[str, str]] = {
    name: f"kafka2pc.E{100 + i:03d}"
    for i, name in enumerate(sorted(POOL_OPTIONS | {"size"}, key=lambda k: (k in _PIPELINE_KEYS, k)))
}


@dataclass(frozen=True)
class SettingProblem:
    """One problem of the ``KAFKA2PC`` setting, with the id ``manage.py check`` reports it under."""

    id: str
    message: str


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

    def writer_options(self) -> WriterOptions:
        """The pool's :class:`~kafka2pc.recipes.dual_write.WriterOptions` (``kafka_timeout_s``: 30 s unless set)."""
        given = {k: v for k, v in self.pool_options.items() if k in _WRITER_KEYS}
        return WriterOptions(**{"kafka_timeout_s": DEFAULT_KAFKA_TIMEOUT_S, **given})

    def pool_keywords(self) -> dict[str, Any]:
        """The ``WriterPool`` arguments of its own among ``pool_options`` (``max_slots``, ``lease_s``,
        ``pipelined``...)."""
        return {k: v for k, v in self.pool_options.items() if k in _POOL_KEYS}

    def prefix_for(self, alias: str) -> str:
        """The pool's prefix for database ``alias``: ``prefix`` for ``default``, ``prefix.alias`` otherwise."""
        return self.prefix if alias == "default" else f"{self.prefix}.{alias}"


def read_settings(value: object) -> Kafka2pcSettings:
    """Check the ``KAFKA2PC`` setting's value; raise :class:`ConfigurationError` naming the first problem."""
    problems, settings = _read(value)
    if problems:
        raise ConfigurationError(problems[0].message)
    assert settings is not None
    return settings


def setting_problems(value: object) -> list[SettingProblem]:
    """Every problem of the ``KAFKA2PC`` setting's value (empty: it is good), each with its check id."""
    return _read(value)[0]


def _read(value: object) -> tuple[list[SettingProblem], Kafka2pcSettings | None]:
    def shape(message: str) -> tuple[list[SettingProblem], None]:
        return [SettingProblem("kafka2pc.E001", message)], None

    if not isinstance(value, Mapping):
        return shape("settings.KAFKA2PC must be a dict with PRODUCER, TRANSACTIONAL_ID_PREFIX and POOL_SIZE "
                     "(see docs/django.md)")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        return shape(f"settings.KAFKA2PC has unknown keys {unknown}; known: {sorted(_KEYS)}")
    producer = value.get("PRODUCER")
    if not isinstance(producer, Mapping) or not producer.get("bootstrap.servers"):
        return shape("settings.KAFKA2PC['PRODUCER'] must be a confluent-kafka configuration dict with "
                     "'bootstrap.servers'")
    if "transactional.id" in producer:
        return shape("settings.KAFKA2PC['PRODUCER'] must not set 'transactional.id': the app leases its ids from "
                     "the pool named by TRANSACTIONAL_ID_PREFIX")
    prefix = value.get("TRANSACTIONAL_ID_PREFIX")
    if not isinstance(prefix, str) or not prefix or len(prefix) > 200:
        return shape("settings.KAFKA2PC['TRANSACTIONAL_ID_PREFIX'] must be a non-empty string of at most 200 "
                     "characters")
    size = value.get("POOL_SIZE", 8)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return shape("settings.KAFKA2PC['POOL_SIZE'] must be a positive integer (the transactional ids of all "
                     "processes together)")
    options = value.get("POOL_OPTIONS", {})
    if not isinstance(options, Mapping):
        return shape("settings.KAFKA2PC['POOL_OPTIONS'] must be a dict of WriterPool arguments")
    bad = sorted(set(options) - POOL_OPTIONS)
    if bad:
        return shape(f"settings.KAFKA2PC['POOL_OPTIONS'] has unknown keys {bad}; known: {sorted(POOL_OPTIONS)}")
    # The values: the recipe's own checks (the ones WriterPool and WriterOptions raise), one id per option.
    problems = [
        SettingProblem(OPTION_CHECK_IDS["pipelined"],
                       f"settings.KAFKA2PC['POOL_OPTIONS']['pipelined'] must be True or False, not {pipelined!r}")
        for pipelined in [options.get("pipelined", False)] if not isinstance(pipelined, bool)
    ]
    problems += [
        SettingProblem(OPTION_CHECK_IDS[p.option],
                       f"settings.KAFKA2PC['POOL_OPTIONS'][{p.option!r}]: {p.message}"
                       if p.option != "size" else f"settings.KAFKA2PC['POOL_SIZE']: {p.message}")
        for p in pool_option_problems(size, options)
    ]
    if problems:
        return problems, None
    return [], Kafka2pcSettings(dict(producer), prefix, size, dict(options))


def current_settings() -> Kafka2pcSettings:
    """``settings.KAFKA2PC``, checked."""
    from django.conf import settings

    return read_settings(getattr(settings, "KAFKA2PC", None))
