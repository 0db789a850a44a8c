"""How a writer runs (:class:`WriterOptions`) and how a pool keeps its ids: one typed value, one validation.

:class:`DualWriter`, :class:`WriterPool`, their asyncio twins and the Django
app all take a :class:`WriterOptions` (their keyword arguments build one).
:func:`writer_option_problems` and :func:`pool_option_problems` are the only
checks of those values: the constructors raise the first problem as a
:class:`~kafka2pc.UsageError`, and the Django app's ``manage.py check``
reports each one with its own id.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kafka2pc import UsageError

from ._values import StepHook

__all__ = [
    "DEFAULT_ACQUIRE_TIMEOUT_S",
    "DEFAULT_LEASE_S",
    "DEFAULT_MAX_SLOTS",
    "DEFAULT_QUEUE_FULL_TIMEOUT_S",
    "DEFAULT_SETTLE_ATTEMPTS",
    "DEFAULT_SETTLE_PARALLELISM",
    "DEFAULT_SLOW_COMMIT_S",
    "MAX_POOL_LOCK_TIMEOUT_S",
    "OptionProblem",
    "WriterOptions",
    "options_from",
    "pool_option_problems",
    "raise_first",
    "writer_option_problems",
]

DEFAULT_QUEUE_FULL_TIMEOUT_S: Final = 60.0
"""How long a produce waits out a full local queue, by default."""
DEFAULT_LEASE_S: Final = 15.0
"""A pool's lease, by default."""
DEFAULT_ACQUIRE_TIMEOUT_S: Final = 30.0
"""How long a pool's transaction waits for a free id, by default."""
DEFAULT_SETTLE_ATTEMPTS: Final = 5
"""How often a recovery retries a completion whose outcome is unknown, by default."""
DEFAULT_SETTLE_PARALLELISM: Final = 8
"""How many orphaned ids a pool settles at once, by default."""
DEFAULT_SLOW_COMMIT_S: Final = 1.0
"""A pipelined Kafka commit slower than this is counted and logged, by default."""
DEFAULT_MAX_SLOTS: Final = 8
"""A pool's slots at most (when its ``size`` is larger), by default."""
MAX_POOL_LOCK_TIMEOUT_S: Final = 10.0
"""A pool's writers wait for a row lock for the lease, at most this long, unless ``lock_timeout_s`` is given."""


@dataclass(frozen=True)
class OptionProblem:
    """One bad option value: its name, and what is wrong with it."""

    option: str
    message: str


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def writer_option_problems(values: Mapping[str, Any]) -> list[OptionProblem]:
    """Every problem with the :class:`WriterOptions` fields in ``values`` (absent ones take their default)."""
    problems: list[OptionProblem] = []
    lock = values.get("lock_timeout_s")
    if lock is not None and (not _number(lock) or lock <= 0):
        problems.append(OptionProblem("lock_timeout_s", "lock_timeout_s must be positive (or None for the "
                                                        "database's own limit)"))
    kafka = values.get("kafka_timeout_s")
    if kafka is not None and (not _number(kafka) or kafka <= 0):
        problems.append(OptionProblem("kafka_timeout_s", "kafka_timeout_s must be positive (or None to wait as "
                                                         "librdkafka does)"))
    attempts = values.get("settle_attempts", 1)
    if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1:
        problems.append(OptionProblem("settle_attempts", "settle_attempts must be at least 1"))
    queue = values.get("queue_full_timeout_s", 0.0)
    if not _number(queue) or queue < 0:
        problems.append(OptionProblem("queue_full_timeout_s", "queue_full_timeout_s must be a number of seconds, "
                                                              "not negative"))
    on_step = values.get("on_step")
    if on_step is not None and not callable(on_step):
        problems.append(OptionProblem("on_step", "on_step must be callable (or None)"))
    return problems


def pool_option_problems(size: object, values: Mapping[str, Any]) -> list[OptionProblem]:
    """Every problem with a pool of ``size`` ids and its keyword arguments in ``values``.

    The :class:`WriterOptions` fields among ``values`` are checked too.
    """
    problems: list[OptionProblem] = []
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        problems.append(OptionProblem("size", "size (the number of transactional ids of the pool) must be at "
                                              "least 1"))
        size = None
    max_slots = values.get("max_slots")
    if max_slots is not None:
        if not isinstance(max_slots, int) or isinstance(max_slots, bool) or max_slots < 1:
            problems.append(OptionProblem("max_slots", f"max_slots must be between 1 and size ({size}), "
                                                       f"not {max_slots!r}"))
        elif size is not None and max_slots > size:
            problems.append(OptionProblem("max_slots", f"max_slots must be between 1 and size ({size}), "
                                                       f"not {max_slots}"))
    for name, positive in (("lease_s", True), ("scan_every_s", True), ("acquire_timeout_s", False),
                           ("slow_commit_s", False)):
        value = values.get(name)
        if value is None:
            continue
        if not _number(value) or (value <= 0 if positive else value < 0):
            problems.append(OptionProblem(name, f"{name} must be {'positive' if positive else 'not negative'}, "
                                                f"not {value!r}"))
    for name in ("settle_parallelism", "max_in_flight"):
        value = values.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            problems.append(OptionProblem(name, f"{name} must be at least 1, not {value!r}"))
    owner = values.get("owner")
    if owner is not None and (not isinstance(owner, str) or not owner):
        problems.append(OptionProblem("owner", "owner must be a non-empty string (or None)"))
    return problems + writer_option_problems(values)


def raise_first(problems: list[OptionProblem]) -> None:
    """Raise the first problem as a :class:`~kafka2pc.UsageError`."""
    if problems:
        raise UsageError(problems[0].message)


@dataclass(frozen=True)
class WriterOptions:
    """How a dual writer runs: one typed, frozen value for :class:`DualWriter`, :class:`WriterPool`, their
    asyncio twins and the Django app (``POOL_OPTIONS``).

    ``retain_records`` keeps each transaction's records in the outbox table
    until Kafka committed them (a heuristic outcome is then re-published).
    ``lock_timeout_s`` bounds the wait for the state row lock (``None``: the
    database's own limit; a pool's default is its lease, capped at 10 s).
    ``kafka_timeout_s`` bounds the prepare, commit and abort calls (``None``:
    librdkafka's own limits).  ``on_step`` is called at every :class:`Step`.
    ``settle_attempts`` bounds the retries of a recovery's completion whose
    outcome is unknown; ``queue_full_timeout_s`` how long a produce waits out
    a full local queue.  Invalid values raise :class:`~kafka2pc.UsageError`.

    Example::

        options = WriterOptions(retain_records=True, kafka_timeout_s=15.0)
        writer = DualWriter(engine, {"bootstrap.servers": "kafka:9092", "transactional.id": "orders-1"},
                            options=options)
        pool = WriterPool(engine, {"bootstrap.servers": "kafka:9092"}, prefix="orders", size=16, options=options)
    """

    retain_records: bool = False
    lock_timeout_s: float | None = None
    kafka_timeout_s: float | None = None
    on_step: StepHook | None = None
    settle_attempts: int = DEFAULT_SETTLE_ATTEMPTS
    queue_full_timeout_s: float = DEFAULT_QUEUE_FULL_TIMEOUT_S

    def __post_init__(self) -> None:
        raise_first(writer_option_problems({
            "lock_timeout_s": self.lock_timeout_s, "kafka_timeout_s": self.kafka_timeout_s,
            "settle_attempts": self.settle_attempts, "queue_full_timeout_s": self.queue_full_timeout_s,
            "on_step": self.on_step,
        }))


_KEYWORD_DEFAULTS: Final[dict[str, Any]] = {
    "retain_records": False, "lock_timeout_s": None, "kafka_timeout_s": None, "on_step": None,
    "settle_attempts": DEFAULT_SETTLE_ATTEMPTS, "queue_full_timeout_s": DEFAULT_QUEUE_FULL_TIMEOUT_S,
}


def options_from(options: WriterOptions | None, **keywords: Any) -> WriterOptions:
    """``options``, or the :class:`WriterOptions` the constructor's keyword arguments spell.

    Giving both ``options`` and a keyword that differs from its default is a
    :class:`~kafka2pc.UsageError` (which one would win is not obvious).
    """
    if options is None:
        return WriterOptions(**keywords)
    if not isinstance(options, WriterOptions):
        raise UsageError(f"options must be a WriterOptions, not {type(options).__name__}")
    given = sorted(k for k, v in keywords.items() if v != _KEYWORD_DEFAULTS[k])
    if given:
        raise UsageError(f"give options=WriterOptions(...) or the keyword arguments {given}, not both")
    return options
