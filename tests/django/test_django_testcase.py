"""``django.test.TestCase`` tests of code that calls ``dual_write()``: the shipped helpers, on a real broker.

A dual write inside a ``TestCase`` runs in the test's transaction: its block is a savepoint, its COMMIT
sends nothing, the Kafka side runs the whole two-phase commit.  These tests are ``TestCase`` classes (one
per database) mixing in :class:`kafka2pc.recipes.django.testing.DualWriteTestMixin`, plus the pytest
fixture with ``django_db`` (the test's transaction) and the ``setting_changed`` receiver.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

import pytest
from django.db import connections, transaction
from django.test import TestCase, override_settings
from djtest.models import Item
from djtest.params import ALIASES, on
from kafka2pc.recipes.django import dual_write
from kafka2pc.recipes.django.models import WriterLease
from kafka2pc.recipes.django.testing import DualWriteTestMixin

from kafka2pc.testing import drain, end_offsets, settled_end_offsets


def _records(bootstrap: str, topic: str) -> list[str]:
    return sorted(r.value.decode() for r in drain(bootstrap, topic, "read_committed") if r.value)


@pytest.fixture(scope="class")
def _broker_setting(request: pytest.FixtureRequest, kafka_bootstrap: str) -> Any:
    """The class's ``KAFKA2PC`` (the session's broker) and topic, for the unittest-style classes below."""
    from kafka2pc.testing import create_topic

    request.cls.bootstrap = kafka_bootstrap
    request.cls.topic = create_topic(kafka_bootstrap, partitions=1)
    with override_settings(KAFKA2PC={
        "PRODUCER": {"bootstrap.servers": kafka_bootstrap},
        "TRANSACTIONAL_ID_PREFIX": "dj-tc",
        "POOL_SIZE": 2,
        "POOL_OPTIONS": {"lease_s": 3.0, "acquire_timeout_s": 20.0, "kafka_timeout_s": 20.0},
    }):
        yield


class _ViewTests(DualWriteTestMixin, TestCase):
    """What a user's ``TestCase`` does: data from ``setUpTestData``, then code that calls ``dual_write()``."""

    __test__ = False
    alias: ClassVar[str]
    bootstrap: ClassVar[str]
    topic: ClassVar[str]

    @classmethod
    def setUpTestData(cls) -> None:
        Item.objects.using(cls.alias).create(id="fixture", series="s")

    def _write(self, rid: str) -> None:
        with dual_write(using=self.alias) as tx:
            Item.objects.using(self.alias).create(id=rid, series="s")
            tx.produce(self.topic, value=rid.encode(), key=rid.encode())

    def _rows(self) -> list[str]:
        return sorted(Item.objects.using(self.alias).values_list("id", flat=True))

    def test_write_commits_the_records_and_keeps_the_rows_in_the_test(self) -> None:
        rid = f"w-{uuid.uuid4().hex[:6]}"
        with self.captureOnCommitCallbacks(using=self.alias) as callbacks:
            self._write(rid)
            self._write(rid + "-2")  # a second block in the same test: the same pool
        self.assertEqual(self._rows(), sorted(["fixture", rid, rid + "-2"]))
        self.assertEqual([r for r in _records(self.bootstrap, self.topic) if r.startswith(rid)], [rid, rid + "-2"])
        self.assertEqual(callbacks, [])  # on_commit: Django's TestCase never runs them by itself
        self.assertTrue(connections[self.alias].in_atomic_block)  # still the test's transaction

    def test_an_exception_rolls_back_the_block_only(self) -> None:
        rid = f"x-{uuid.uuid4().hex[:6]}"
        with self.assertRaises(ZeroDivisionError):
            with dual_write(using=self.alias) as tx:
                Item.objects.using(self.alias).create(id=rid, series="s")
                tx.produce(self.topic, value=rid.encode())
                1 / 0  # noqa: B018
        self.assertEqual(self._rows(), ["fixture"])  # the block's savepoint rolled back, the test's data stays
        self._write(rid + "-after")
        self.assertEqual(self._rows(), sorted(["fixture", rid + "-after"]))
        records = [r for r in _records(self.bootstrap, self.topic) if r.startswith(rid)]
        self.assertEqual(records, [rid + "-after"])  # the first block's record was aborted
        self.assertEqual(settled_end_offsets(self.bootstrap, self.topic),
                         end_offsets(self.bootstrap, self.topic, "read_uncommitted"))

    def test_a_user_atomic_block_is_still_refused(self) -> None:
        from kafka2pc.recipes.django import NestedAtomicError

        with transaction.atomic(using=self.alias), self.assertRaisesRegex(NestedAtomicError, "outermost"):
            with dual_write(using=self.alias):
                self.fail("the block must not run")  # pragma: no cover


def _class_for(alias: str) -> type[_ViewTests]:
    marks = pytest.mark.usefixtures("_broker_setting")
    return marks(type(f"TestViewsIn{ALIASES[alias].capitalize()}TestCase", (_ViewTests,),
                      {"alias": alias, "databases": {"default", alias}, "__module__": __name__, "__test__": True}))


TestViewsInPostgresqlTestCase = _class_for("pg")
TestViewsInMariadbTestCase = _class_for("maria")


class TestSqliteTestCaseIsRefused(DualWriteTestMixin, TestCase):
    """SQLite admits one writer: inside the test's transaction the pool could not write its leases."""

    def test_refused_with_the_way_out(self) -> None:
        from kafka2pc.recipes.django import NestedAtomicError

        with self.assertRaisesRegex(NestedAtomicError, "TransactionTestCase"):
            with dual_write():
                self.fail("the block must not run")  # pragma: no cover
        self.assertFalse(Item.objects.exists())


@pytest.mark.parametrize("alias", [pytest.param(a, marks=pytest.mark.django_db(databases=["default", a]),
                                                id=ALIASES[a]) for a in ("pg", "maria")])
def test_pytest_fixture_in_the_tests_transaction(alias: str, k2pc_settings: dict[str, Any], pipelined: bool,
                                                 kafka2pc_pools: dict[str, Any], kafka_bootstrap: str,
                                                 topic_factory: Any) -> None:
    """Pipelined too: a block in the test's transaction waits for its Kafka commit, so the test reads it at once."""
    topic = topic_factory()
    assert kafka2pc_pools["POOL_OPTIONS"].get("pipelined", False) is pipelined
    assert kafka2pc_pools["TRANSACTIONAL_ID_PREFIX"].startswith(k2pc_settings["TRANSACTIONAL_ID_PREFIX"] + "-t")
    with dual_write(using=alias) as tx:
        Item.objects.using(alias).create(id="p", series="s")
        tx.produce(topic, value=b"p")
    from kafka2pc.recipes.django._runtime import runtime_for

    assert runtime_for(alias).pool.metrics().commits_in_flight == 0  # the block waited for its Kafka commit
    assert list(Item.objects.using(alias).values_list("id", flat=True)) == ["p"]
    assert _records(kafka_bootstrap, topic) == ["p"]
    held = WriterLease.objects.using(alias).exclude(owner=None).values_list("transactional_id", flat=True)
    assert all(t.startswith(kafka2pc_pools["TRANSACTIONAL_ID_PREFIX"]) for t in held)


@pytest.mark.parametrize("alias", on("default"), indirect=True)
def test_override_settings_takes_effect(alias: str, k2pc_settings: dict[str, Any], kafka_bootstrap: str,
                                        topic_factory: Any) -> None:
    from kafka2pc.recipes.django._runtime import runtime_for

    topic = topic_factory()
    with dual_write(using=alias) as tx:
        tx.produce(topic, value=b"1")
    before = runtime_for(alias).pool.prefix
    with override_settings(KAFKA2PC={**k2pc_settings, "TRANSACTIONAL_ID_PREFIX": before + "-other"}):
        with dual_write(using=alias) as tx:
            tx.produce(topic, value=b"2")
        assert runtime_for(alias).pool.prefix == before + "-other"
    assert runtime_for(alias).pool.prefix == before
    assert _records(kafka_bootstrap, topic) == ["1", "2"]
