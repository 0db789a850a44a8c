"""Test helpers: views that call ``dual_write()`` under ``django.test.TestCase`` and pytest-django.

A dual write inside a ``TestCase`` runs in the test's transaction (see
:func:`~kafka2pc.recipes.django.dual_write`): it needs no flush of the
database, and its rows disappear with the test's rollback, as every write of a
``TestCase``.  What a test needs around it is a pool of its own, closed at the
test's end: the pool's state rows were updated in a transaction that Django
rolls back, so a pool kept for the next test would find them changed and
fence itself.  :class:`DualWriteTestMixin` (unittest style) and the
:func:`kafka2pc_pools` fixture (pytest) give each test that.

::

    from django.test import TestCase
    from kafka2pc.recipes.django.testing import DualWriteTestMixin

    class OrderViewTests(DualWriteTestMixin, TestCase):
        def test_post(self):
            response = self.client.post("/orders", {...}, content_type="application/json")
            self.assertEqual(response.status_code, 201)

Each test's pool has the prefix ``TRANSACTIONAL_ID_PREFIX`` plus ``-t`` and
a hexadecimal suffix that grows from test to test (:func:`test_prefix`): no
test waits for the leases, or the row locks, of the tests before it.  The broker is the real one of
``KAFKA2PC["PRODUCER"]``, with two-phase commit: the records of a committed
block are committed in Kafka (a ``read_committed`` consumer sees them), those
of a rolled-back block are aborted.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.test.utils import override_settings

from ._runtime import close_all

__all__ = ["DualWriteTestMixin", "isolated_pools", "kafka2pc_pools"]

#: How long closing a test's pools may wait for a transaction still running (seconds).
TEST_CLOSE_TIMEOUT_S = 10.0


def test_prefix(prefix: str) -> str:
    """A prefix of its own for one test: ``prefix``, ``-t``, the time in ns (hexadecimal) and 4 random digits.

    Each test's ids sort after those of the tests before it.  On MySQL and
    MariaDB that matters: InnoDB keeps the row locks of a ``TestCase``
    class's transaction until the class ends (a rollback to a savepoint
    releases none), and a new id's state row, inserted after every locked
    one, never waits on their gap locks.
    """
    return f"{prefix}-t{time.time_ns():x}{uuid.uuid4().hex[:4]}"


@contextmanager
def isolated_pools() -> Iterator[dict[str, Any]]:
    """Inside: ``settings.KAFKA2PC`` with a fresh ``TRANSACTIONAL_ID_PREFIX``; at the exit the pools are closed.

    Yields the setting in effect.  The pools made inside are closed at the
    exit (each waits up to :data:`TEST_CLOSE_TIMEOUT_S` for a transaction
    still running), before the setting is restored.
    """
    value = dict(getattr(settings, "KAFKA2PC", None) or {})
    if "TRANSACTIONAL_ID_PREFIX" in value:
        value["TRANSACTIONAL_ID_PREFIX"] = test_prefix(str(value["TRANSACTIONAL_ID_PREFIX"]))
    override = override_settings(KAFKA2PC=value)
    override.enable()  # setting_changed: the app's receiver closes the pools of the previous value
    try:
        yield value
    finally:
        try:
            close_all(TEST_CLOSE_TIMEOUT_S)
        finally:
            override.disable()


class DualWriteTestMixin:
    """Mix into a ``django.test.TestCase`` (or ``TransactionTestCase``) whose tests run views calling ``dual_write()``.

    Each test runs with a pool of its own (:func:`isolated_pools`).  Its
    pools are closed after ``TestCase``'s rollback, and before
    ``TransactionTestCase``'s flush.  Put the mixin first:
    ``class MyTests(DualWriteTestMixin, TestCase)``.
    """

    _kafka2pc_pools: Any = None

    @classmethod
    def _pre_setup(cls) -> None:
        pools = isolated_pools()
        pools.__enter__()
        cls._kafka2pc_pools = pools
        super()._pre_setup()  # type: ignore[misc]

    def _post_teardown(self) -> None:
        from django.test import TestCase

        pools, type(self)._kafka2pc_pools = type(self)._kafka2pc_pools, None
        rolled_back = isinstance(self, TestCase) and self._databases_support_transactions()
        try:
            if not rolled_back:
                close_all(TEST_CLOSE_TIMEOUT_S)  # before the flush: no pool renews a lease the flush deletes
            super()._post_teardown()  # type: ignore[misc]
        finally:
            if pools is not None:
                pools.__exit__(None, None, None)


try:
    import pytest
except ImportError:  # pragma: no cover - pytest is a test dependency
    pass
else:

    @pytest.fixture
    def kafka2pc_pools() -> Iterator[dict[str, Any]]:
        """pytest: a pool of its own for the test, closed at its end (:func:`isolated_pools`); yields the setting.

        Load it with ``pytest_plugins = ["kafka2pc.recipes.django.testing"]`` in
        ``conftest.py``.  With ``@pytest.mark.django_db`` (the test's
        transaction) and with ``transaction=True`` (a flush) alike.
        """
        with isolated_pools() as value:
            yield value
