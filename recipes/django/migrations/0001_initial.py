"""The state, lease and outbox tables, created with the DDL the SQLAlchemy recipe emits (same layout).

The outbox table (``kafka_transaction_outbox``) is used only with ``POOL_OPTIONS["retain_records"]``.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


def _tables() -> list[Any]:
    import sqlalchemy as sa
    from kafka2pc.recipes.dual_write import define_lease_table, define_outbox_table, define_state_table

    metadata = sa.MetaData()
    return [define_state_table(metadata), define_lease_table(metadata), define_outbox_table(metadata)]


def _dialect(schema_editor: Any) -> Any:
    import sqlalchemy as sa
    from kafka2pc.recipes.django._engines import dialect_url

    return sa.create_engine(dialect_url(schema_editor.connection)).dialect


def create_tables(apps: Any, schema_editor: Any) -> None:
    """Each table the SQLAlchemy recipe would create, unless it exists already (a database both recipes use)."""
    from kafka2pc.recipes.dual_write import state_function_sql
    from sqlalchemy.schema import CreateIndex, CreateTable

    dialect = _dialect(schema_editor)
    with schema_editor.connection.cursor() as cursor:
        existing = set(schema_editor.connection.introspection.table_names(cursor))
    for table in _tables():
        if table.name not in existing:
            schema_editor.execute(str(CreateTable(table).compile(dialect=dialect)), params=None)
            for index in sorted(table.indexes, key=lambda i: str(i.name)):
                schema_editor.execute(str(CreateIndex(index).compile(dialect=dialect)), params=None)
        if table.name == "kafka_transaction_state" and dialect.name == "postgresql":
            schema_editor.execute(state_function_sql(table), params=None)


def drop_tables(apps: Any, schema_editor: Any) -> None:
    dialect = _dialect(schema_editor)
    quote = dialect.identifier_preparer.quote
    for table in reversed(_tables()):
        schema_editor.execute(f"DROP TABLE {quote(table.name)}", params=None)
        if table.name == "kafka_transaction_state" and dialect.name == "postgresql":
            schema_editor.execute("DROP FUNCTION IF EXISTS kafka2pc_store_kafka_transaction_state"
                                  "(text, text, text, text, timestamp)", params=None)


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(create_tables, drop_tables)],
            state_operations=[
                migrations.CreateModel(
                    name="TransactionState",
                    fields=[
                        ("transactional_id", models.CharField(max_length=255, primary_key=True, serialize=False)),
                        ("prepared_txn_state", models.CharField(blank=True, max_length=255, null=True)),
                        ("updated_at", models.DateTimeField(blank=True, null=True)),
                    ],
                    options={"db_table": "kafka_transaction_state", "verbose_name": "transaction state",
                             "ordering": ["transactional_id"]},
                ),
                migrations.CreateModel(
                    name="WriterLease",
                    fields=[
                        ("transactional_id", models.CharField(max_length=255, primary_key=True, serialize=False)),
                        ("pool", models.CharField(db_index=True, max_length=255)),
                        ("owner", models.CharField(blank=True, max_length=255, null=True)),
                        ("expires_at", models.DateTimeField(blank=True, null=True)),
                        ("epoch", models.BigIntegerField(default=0)),
                    ],
                    options={"db_table": "kafka_writer_lease", "verbose_name": "writer lease",
                             "ordering": ["transactional_id"]},
                ),
            ],
        ),
    ]
