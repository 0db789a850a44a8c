"""One :class:`~kafka2pc.recipes.dual_write.WriterPool` per database alias and process, made on first use.

A pool holds producers and background threads, which do not survive a
``fork``: the runtime remembers the process id it was made in, and a forked
worker (gunicorn's, say, after a ``--preload`` master touched it) makes its
own.  Nothing is made at import or in ``AppConfig.ready()``.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import sqlalchemy as sa

from kafka2pc import DEFAULT_CLOSE_TIMEOUT_S, UsageError

from ..dual_write import (
    DEFAULT_LEASE_TABLE,
    DEFAULT_OUTBOX_TABLE,
    DEFAULT_STATE_TABLE,
    MissingTableError,
    WriterPool,
    define_lease_table,
    define_state_table,
)
from ..dual_write._options import DEFAULT_MAX_SLOTS
from ._engines import borrowed_engine, own_engine, test_case_engine
from ._settings import DEFAULT_KAFKA_TIMEOUT_S, Kafka2pcSettings, current_settings

__all__ = ["DEFAULT_KAFKA_TIMEOUT_S", "AliasRuntime", "MigrationMissingError", "close", "close_all", "existing_runtime",
           "on_setting_changed", "runtime_for"]

logger = logging.getLogger("kafka2pc.recipes.django")

class MigrationMissingError(MissingTableError):
    """The app's tables are missing in this database: run ``python manage.py migrate kafka2pc``."""


@dataclass
class AliasRuntime:
    """The engines and the pool of one database alias in this process.

    The two engines on Django's own connection are made at their first use:
    the borrowed one outside any ``transaction.atomic`` (its dialect is
    initialised on a connection in autocommit), the test-case one inside a
    ``django.test.TestCase``'s transaction.
    """

    alias: str
    settings: Kafka2pcSettings
    own: sa.Engine
    pool: WriterPool
    _borrowed: sa.Engine | None = None
    _test_case: sa.Engine | None = None

    def borrowed(self) -> sa.Engine:
        """The engine on Django's connection of this thread (see ``_engines.borrowed_engine``)."""
        if self._borrowed is None:
            with _lock:
                if self._borrowed is None:
                    self._borrowed = borrowed_engine(self.alias)
        return self._borrowed

    def test_case(self) -> sa.Engine:
        """The engine of a dual write inside a ``TestCase``'s transaction (``_engines.test_case_engine``)."""
        if self._test_case is None:
            with _lock:
                if self._test_case is None:
                    self._test_case = test_case_engine(self.alias)
        return self._test_case

    def close(self, timeout: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Close the pool (leases given back or left to expire, see ``WriterPool.close``) and the engines."""
        try:
            self.pool.close(timeout)
        finally:
            self.own.dispose()


_lock = threading.Lock()
_runtimes: dict[str, AliasRuntime] = {}
_pid = os.getpid()


def _check_tables(engine: sa.Engine, alias: str, *, outbox: bool) -> None:
    inspector = sa.inspect(engine)
    needed = (DEFAULT_STATE_TABLE, DEFAULT_LEASE_TABLE) + ((DEFAULT_OUTBOX_TABLE,) if outbox else ())
    missing = [t for t in needed if not inspector.has_table(t)]
    if missing:
        raise MigrationMissingError(
            f"database {alias!r} has no {' and no '.join(missing)} table: run "
            f"`python manage.py migrate kafka2pc --database {alias}` (kafka2pc.recipes.django's migrations)"
        )


def _make(alias: str) -> AliasRuntime:
    settings = current_settings()
    options, keywords = settings.writer_options(), settings.pool_keywords()
    slots = int(keywords.get("max_slots") or min(settings.pool_size, DEFAULT_MAX_SLOTS))
    own = own_engine(alias, pool_size=max(2, slots + 2))
    try:
        _check_tables(own, alias, outbox=options.retain_records)
        metadata = sa.MetaData()
        pool = WriterPool(
            own, settings.producer, prefix=settings.prefix_for(alias), size=settings.pool_size,
            state_table=define_state_table(metadata), lease_table=define_lease_table(metadata), start=False,
            options=options, **keywords,
        )
    except BaseException:
        own.dispose()
        raise
    logger.info("kafka2pc: pool %r of %d ids on database %r (owner %s)", pool.prefix, settings.pool_size, alias,
                pool.owner)
    return AliasRuntime(alias, settings, own, pool)


def runtime_for(alias: str, *, start: bool = True) -> AliasRuntime:
    """This process's runtime of ``alias``, made on first use (again after a fork).

    ``start=False`` leaves a new pool's background loops (lease renewal, orphan scan) unstarted, for
    :func:`~kafka2pc.recipes.django.recover` to settle orphans itself first.
    """
    runtime = _runtime(alias)
    if start:
        runtime.pool.start()  # once: later calls return at once
    return runtime


def existing_runtime(alias: str) -> AliasRuntime | None:
    """This process's runtime of ``alias`` if one was made (never makes one)."""
    runtime = _runtimes.get(alias)
    return runtime if runtime is not None and _pid == os.getpid() else None


def _runtime(alias: str) -> AliasRuntime:
    global _pid
    runtime = _runtimes.get(alias)
    if runtime is not None and _pid == os.getpid():
        return runtime
    with _lock:
        if _pid != os.getpid():  # forked: the parent's producers and threads are not ours
            _runtimes.clear()
            _pid = os.getpid()
        runtime = _runtimes.get(alias)
        if runtime is None:
            runtime = _runtimes[alias] = _make(alias)
        return runtime


def close(timeout: float | None = None) -> None:
    """Close this process's pools (at a worker's exit: gunicorn ``worker_exit``, ``atexit`` in an ASGI module).

    Each pool drains and gives its leases back (those with a transaction in
    doubt are left to expire, for a survivor's recovery), waiting up to
    ``timeout`` seconds (``None``: :data:`~kafka2pc.DEFAULT_CLOSE_TIMEOUT_S`) for transactions still running
    and for pipelined Kafka commits (one not finished by then is left to the recovery of its id).
    The next ``dual_write()`` makes a new pool.
    """
    if timeout is not None and timeout < 0:
        raise UsageError(f"close(timeout={timeout}): a timeout is in seconds and not negative")
    close_all(DEFAULT_CLOSE_TIMEOUT_S if timeout is None else timeout)


def on_setting_changed(*, setting: str, **kwargs: object) -> None:
    """Django's ``setting_changed`` receiver: a new ``KAFKA2PC`` (``override_settings``) closes the pools.

    The next ``dual_write()`` makes its pool from the setting then in effect.
    """
    if setting == "KAFKA2PC":
        close_all(DEFAULT_CLOSE_TIMEOUT_S)


def close_all(timeout: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
    """Close every runtime of this process (see :func:`close`)."""
    with _lock:
        runtimes = list(_runtimes.values()) if _pid == os.getpid() else []
        _runtimes.clear()
    for runtime in runtimes:
        try:
            runtime.close(timeout)
        except Exception as exc:  # noqa: BLE001 - closing the others matters more
            logger.warning("kafka2pc: closing the pool of %r failed: %s", runtime.alias, exc)
