"""The app's migration and admin on real SQLite, PostgreSQL and MariaDB: what a DBA and an operator see.

``makemigrations --check`` finds nothing to do; ``sqlmigrate`` prints the DDL (and the state function on
PostgreSQL); reversing the migration keeps a table that holds another writer's rows; timestamps come back
aware; the admin lists every alias in one query per page, whatever the number of rows.
"""

from __future__ import annotations

import datetime
import io
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connections
from django.test.utils import CaptureQueriesContext
from djtest.params import on
from kafka2pc.recipes.django import dual_write
from kafka2pc.recipes.django.models import TransactionState, WriterLease


@pytest.mark.django_db(databases="__all__")
def test_makemigrations_finds_nothing_to_do() -> None:
    call_command("makemigrations", "kafka2pc", "--check", "--dry-run", verbosity=0)  # SystemExit(1) otherwise


@pytest.mark.parametrize("alias", on("default", "pg", "maria"), indirect=True)
def test_sqlmigrate_prints_the_ddl(alias: str) -> None:
    out = io.StringIO()
    call_command("sqlmigrate", "kafka2pc", "0001", database=alias, stdout=out)
    sql = out.getvalue()
    for table in ("kafka_transaction_state", "kafka_writer_lease", "kafka_transaction_outbox"):
        assert f"CREATE TABLE {table}" in sql.replace('"', "").replace("`", ""), sql
    assert ("FUNCTION" in sql) is (connections[alias].vendor == "postgresql")
    out = io.StringIO()
    call_command("sqlmigrate", "kafka2pc", "0001", "--backwards", database=alias, stdout=out)
    assert "DROP TABLE" in out.getvalue()


@pytest.mark.parametrize("alias", on("default", "pg", "maria"), indirect=True)
def test_reversing_keeps_a_table_another_writer_uses(alias: str, kafka_bootstrap: str, topic_factory: Any) -> None:
    from kafka2pc.recipes.django._runtime import close_all

    topic = topic_factory()
    TransactionState.objects.using(alias).all().delete()  # rows other tests' pools committed (TestCase's are kept)
    WriterLease.objects.using(alias).all().delete()
    with connections[alias].cursor() as cursor:
        cursor.execute("DELETE FROM kafka_transaction_outbox")
    with dual_write(using=alias) as tx:
        tx.produce(topic, value=b"x")
    close_all()
    WriterLease.objects.using(alias).create(transactional_id="orders-sa-0", pool="orders-sa")  # a SQLAlchemy service
    tables = connections[alias].introspection.table_names
    try:
        call_command("migrate", "kafka2pc", "zero", database=alias, verbosity=0)
        with connections[alias].cursor() as cursor:
            left = set(tables(cursor))
        assert "kafka_writer_lease" in left  # the service's lease row is there: kept
        assert "kafka_transaction_state" not in left and "kafka_transaction_outbox" not in left  # only the app's
        assert "orders-sa" in WriterLease.objects.using(alias).values_list("pool", flat=True)  # untouched
    finally:
        call_command("migrate", "kafka2pc", database=alias, verbosity=0)
    with connections[alias].cursor() as cursor:
        assert {"kafka_transaction_state", "kafka_writer_lease", "kafka_transaction_outbox"} <= set(tables(cursor))
    with dual_write(using=alias) as tx:  # the tables are whole again
        tx.produce(topic, value=b"y")


@pytest.mark.parametrize("alias", on("default", "pg", "maria"), indirect=True)
def test_timestamps_come_back_aware_in_utc(alias: str, kafka_bootstrap: str, topic_factory: Any) -> None:
    topic = topic_factory()
    with dual_write(using=alias) as tx:
        tx.produce(topic, value=b"x")
    now = datetime.datetime.now(datetime.timezone.utc)
    (state,) = TransactionState.objects.using(alias).exclude(prepared_txn_state=None)
    lease = WriterLease.objects.using(alias).get(transactional_id=state.transactional_id)
    for stamp in (state.updated_at, lease.expires_at):
        assert stamp is not None and stamp.utcoffset() == datetime.timedelta(0)
    assert abs(now - state.updated_at) < datetime.timedelta(minutes=1)  # UTC, not local time read as UTC


@pytest.mark.parametrize("alias", [pytest.param("pg", id="postgresql", marks=pytest.mark.django_db(
    transaction=True, databases=["default", "pg"]))], indirect=True)
def test_the_admin_lists_every_alias_in_one_query_per_page(alias: str, admin_client: Any) -> None:
    def page(rows: int) -> tuple[int, str]:
        TransactionState.objects.using(alias).all().delete()
        WriterLease.objects.using(alias).all().delete()
        for i in range(rows):
            TransactionState.objects.using(alias).create(transactional_id=f"p-{i}", prepared_txn_state=f"{i}:0")
            WriterLease.objects.using(alias).create(transactional_id=f"p-{i}", pool="p", owner=f"w{i}")
        with CaptureQueriesContext(connections[alias]) as queries:
            response = admin_client.get(f"/admin/kafka2pc/transactionstate/?database={alias}")
        assert response.status_code == 200
        return len(queries), response.content.decode()

    one, _ = page(1)
    many, html = page(7)
    assert one == many  # no query per row
    assert all(f"w{i}" in html for i in range(7))  # the lease owner column, from the subquery
    assert f"?database={alias}" in html and "?database=default" in html  # every alias can be chosen
    leases = admin_client.get(f"/admin/kafka2pc/writerlease/?database={alias}")
    assert leases.status_code == 200 and "w6" in leases.content.decode()
