"""Logging of the two client libraries underneath: one clear line per condition, at the right level.

kafka2pc logs through :mod:`logging` only, and it brings the two client
libraries it is built on into line:

* **librdkafka** (confluent-kafka) writes raw ``%3|...|FAIL|...`` lines to
  stderr by default, one per reconnect attempt and broker handle: hundreds
  during a short broker outage.  kafka2pc gives every confluent-kafka client
  it creates the ``logger`` setting (unless the configuration already has
  one), so librdkafka's logs go to the ``kafka2pc.librdkafka`` logger.
  A :class:`ConditionFilter` on that logger passes the first line of each
  condition (same facility and text, ignoring the broker handle, the thread
  and the retry counters) and drops its repeats for ``window_s`` seconds;
  after that, the next repeat is passed once more with how many were
  dropped.  A broker that cannot be reached is logged at WARNING (librdkafka
  says ERROR, but it reconnects by itself; the application hears of it
  through the calls that fail), a condition librdkafka retries by itself
  ("...: retrying") at INFO.

  confluent-kafka forwards librdkafka's logs from ``poll()``, ``flush()``
  and the calls that wait on them (``prepare_transaction``); a producer that
  is never polled keeps them queued in memory until it is.

* **kafka-python** (the control plane) logs about twenty INFO lines while it
  connects (bootstrap, version probe, metadata).  A :class:`DemoteInfoFilter`
  on kafka-python's loggers turns their INFO records into DEBUG records, so
  they appear only where DEBUG is enabled; its warnings and errors pass
  through the same condition filter.  Loggers' levels and handlers are not
  changed (a logger's level would also silence what a user asked to see);
  if the application configured the ``kafka`` logger itself (a level or a
  handler), kafka2pc leaves kafka-python alone.

To see everything, as it comes::

    logging.getLogger("kafka2pc.librdkafka").setLevel(logging.DEBUG)
    for f in list(logging.getLogger("kafka2pc.librdkafka").filters):
        logging.getLogger("kafka2pc.librdkafka").removeFilter(f)

or pass your own ``logger`` in the producer configuration.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "LIBRDKAFKA_LOGGER_NAME",
    "UNREACHABLE",
    "ConditionFilter",
    "DemoteInfoFilter",
    "LibrdkafkaFilter",
    "librdkafka_logger",
    "quiet_kafka_python",
    "with_librdkafka_logger",
]

LIBRDKAFKA_LOGGER_NAME = "kafka2pc.librdkafka"
"""The logger librdkafka's messages go to (through confluent-kafka's ``logger`` setting)."""

DEFAULT_WINDOW_S = 300.0

# "[thrd:127.0.0.1:9092/bootstrap]: " -- the librdkafka thread, the same condition on any handle.
_THREAD_PREFIX = re.compile(r"^\[thrd:[^\]]*\]:\s*")
# "127.0.0.1:9092/bootstrap", "127.0.0.1:9092/1", "TxnCoordinator/1": the handle, not the broker.
_HANDLE_SUFFIX = re.compile(r"(?<=\d)/(?:bootstrap|\d+)\b")
# "(after 0ms in state CONNECT, 4 identical error(s) suppressed)" and "after 1234ms".
_AFTER = re.compile(r"\s*\(after \d+ms(?: in state \w+)?(?:, \d+ identical error\(s\) suppressed)?\)")
_NUMBERS = re.compile(r"\d+(?:\.\d+)?(?:ms|s)?")
# The many ways both libraries say "a broker cannot be reached" (one condition: Kafka unreachable).
_UNREACHABLE = re.compile(
    r"connect to .* failed|connection refused|econnrefused|disconnected|brokers are down|"
    r"timed out \d* ?in-flight|connection reset|transport failure|host resolution failure|"
    r"connection lost|connection failed|metadata refresh: failed|kafkaconnectionerror|"
    r"not found in cache|node not ready|no node available|error receiving network data",
    re.IGNORECASE,
)
UNREACHABLE = "unreachable"
"""The condition name of every "cannot reach a broker" message (see :class:`ConditionFilter`)."""


def _source(record: logging.LogRecord) -> str:
    if record.name == LIBRDKAFKA_LOGGER_NAME or record.name.startswith(LIBRDKAFKA_LOGGER_NAME + "."):
        return "librdkafka"
    if record.name == "kafka" or record.name.startswith("kafka."):
        return "kafka-python"
    return record.name


def _condition_key(record: logging.LogRecord, text: str) -> tuple[str, int, str]:
    if record.levelno >= logging.WARNING and _UNREACHABLE.search(text):
        return (_source(record), logging.WARNING, UNREACHABLE)
    return (_source(record), record.levelno, _NUMBERS.sub("#", _HANDLE_SUFFIX.sub("", text)))


class ConditionFilter(logging.Filter):
    """Pass the first record of each condition; drop its repeats for ``window_s`` seconds.

    A condition is a source (librdkafka, kafka-python or the logger's name),
    a level and a message text with numbers masked.  Every WARNING-or-worse
    message saying that a broker cannot be reached (refused, disconnected,
    timed out, metadata refresh failed...) is one condition per source,
    "unreachable", logged at WARNING: the clients reconnect by themselves,
    and the application learns of it from the calls that fail.
    After ``window_s`` the next repeat passes again, saying how many were
    dropped, so a condition that lasts is still visible once per window.
    Thread-safe; the clock is injectable for tests.
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        """True to emit ``record`` (possibly with a "repeated N times" note), False to drop it."""
        key = _condition_key(record, record.getMessage())
        if key[2] == UNREACHABLE:
            if record.levelno > logging.WARNING:
                record.levelno, record.levelname = logging.WARNING, "WARNING"
            if record.exc_info and record.exc_info[1] is not None:  # a reset socket needs no traceback
                error = record.exc_info[1]
                record.msg, record.args = f"{record.getMessage()} ({type(error).__name__}: {error})", ()
                record.exc_info = record.exc_text = None
        now = self._clock()
        with self._lock:
            first, dropped = self._seen.get(key, (None, 0))
            if first is not None and now - first < self.window_s:
                self._seen[key] = (first, dropped + 1)
                return False
            self._seen[key] = (now, 0)
            if len(self._seen) > 1000:  # bounded: forget the oldest conditions
                for old in sorted(self._seen, key=lambda k: self._seen[k][0])[:500]:
                    del self._seen[old]
        if dropped and first is not None:
            record.msg = f"{record.getMessage()} (and {dropped} more like it in the last {now - first:.0f}s)"
            record.args = ()
        if key[2] == UNREACHABLE:
            record.msg = (
                f"Kafka unreachable ({key[0]} reconnects by itself; not logged again for "
                f"{self.window_s:.0f}s): {record.getMessage()}"
            )
            record.args = ()
        return True


class LibrdkafkaFilter(ConditionFilter):
    """:class:`ConditionFilter` for confluent-kafka's log records, which it also makes readable.

    confluent-kafka logs ``"%s [%s] %s" % (facility, client name, text)``
    with librdkafka's syslog level.  The record becomes
    ``"<client name> <FACILITY>: <text>"`` without the thread prefix and
    retry counters; an unreachable broker is a WARNING, a condition
    librdkafka retries by itself an INFO.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite, re-level and de-duplicate one librdkafka record."""
        if isinstance(record.args, tuple) and len(record.args) == 3 and record.msg == "%s [%s] %s":
            facility, client, text = (str(a) for a in record.args)
            text = _AFTER.sub("", _THREAD_PREFIX.sub("", text)).rstrip()
            record.msg, record.args = "%s %s: %s", (client, facility, text)
            record.librdkafka_facility = facility
            level = record.levelno
            if level >= logging.WARNING and text.endswith("retrying"):
                level = logging.INFO
            if level != record.levelno:
                record.levelno, record.levelname = level, logging.getLevelName(level)
                if not logging.getLogger(record.name).isEnabledFor(level):
                    return False
        return super().filter(record)


class DemoteInfoFilter(logging.Filter):
    """Turn INFO records into DEBUG records (and drop them where DEBUG is not enabled).

    For kafka-python's connection chatter: it stays available to whoever
    enables DEBUG, without changing any logger's level.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Demote an INFO record; pass every other record."""
        if record.levelno == logging.INFO:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


_install_lock = threading.Lock()
_librdkafka_filter = LibrdkafkaFilter()
_kafka_python_filters: tuple[logging.Filter, ...] = (DemoteInfoFilter(), ConditionFilter())
_kafka_python_done: set[str] = set()


def librdkafka_logger() -> logging.Logger:
    """The ``kafka2pc.librdkafka`` logger, with its :class:`LibrdkafkaFilter` installed."""
    logger = logging.getLogger(LIBRDKAFKA_LOGGER_NAME)
    with _install_lock:
        if _librdkafka_filter not in logger.filters:
            logger.addFilter(_librdkafka_filter)
    return logger


def with_librdkafka_logger(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``logger`` set to :func:`librdkafka_logger` unless it has one (in place; returned)."""
    if "logger" not in config:
        config["logger"] = librdkafka_logger()
    return config


def _user_configured_kafka_logger() -> bool:
    kafka = logging.getLogger("kafka")
    # kafka-python itself gives its "kafka" logger a NullHandler: that is not the application's doing.
    handlers = [h for h in kafka.handlers if not isinstance(h, logging.NullHandler)]
    return kafka.level != logging.NOTSET or bool(handlers) or any(
        f not in _kafka_python_filters for f in kafka.filters
    )


def _kafka_python_module_names() -> list[str]:
    """Every module of the installed kafka-python, found on disk without importing it.

    kafka-python's modules log to ``logging.getLogger(__name__)``, and many
    are imported only when a client connects; creating their loggers first
    (with the filters) covers the records logged while it connects.
    """
    global _module_names
    if _module_names is None:
        import importlib.util

        spec = importlib.util.find_spec("kafka")
        names: list[str] = []
        for root in spec.submodule_search_locations or [] if spec is not None else []:
            base = Path(root)
            for path in base.rglob("*.py"):
                parts = path.relative_to(base).with_suffix("").parts
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                names.append(".".join(("kafka", *parts)))
        _module_names = sorted(set(names))
    return _module_names


_module_names: list[str] | None = None


def quiet_kafka_python() -> bool:
    """Install :class:`DemoteInfoFilter` and a :class:`ConditionFilter` on kafka-python's loggers.

    Idempotent and cheap (called whenever a control plane is created, so
    that loggers of kafka-python modules imported since are covered too).
    Returns False, changing nothing, when the application configured the
    ``kafka`` logger itself.
    """
    if _user_configured_kafka_logger():
        return False
    with _install_lock:
        names = [
            name for name in (*_kafka_python_module_names(), *list(logging.Logger.manager.loggerDict))
            if (name == "kafka" or name.startswith("kafka.")) and name not in _kafka_python_done
        ]
        for name in names:
            logger = logging.getLogger(name)
            for flt in _kafka_python_filters:
                if flt not in logger.filters:
                    logger.addFilter(flt)
            _kafka_python_done.add(name)
    return True
