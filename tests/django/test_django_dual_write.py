"""kafka2pc.recipes.django on a real broker and real SQLite, PostgreSQL and MariaDB (pytest-django)."""

from __future__ import annotations

from typing import Any

from django.db import connections
from djtest.models import Item
from kafka2pc.recipes.django import dual_write

from kafka2pc.testing import drain


def _ids(bootstrap: str, topic: str) -> list[str]:
    return sorted(r.value.decode() for r in drain(bootstrap, topic, "read_committed") if r.value)


def test_rows_and_records_commit_together(alias: str, kafka_bootstrap: str, topic_factory: Any) -> None:
    topic = topic_factory()
    with dual_write(using=alias) as tx:
        Item.objects.using(alias).create(id="a", series="s")
        tx.produce(topic, value=b"a", key=b"a")
    with dual_write(using=alias) as tx:
        Item.objects.using(alias).create(id="b", series="s")
        tx.produce(topic, value=b"b", key=b"b")
    assert sorted(Item.objects.using(alias).values_list("id", flat=True)) == ["a", "b"]
    assert _ids(kafka_bootstrap, topic) == ["a", "b"]
    assert connections[alias].get_autocommit() and not connections[alias].in_atomic_block
