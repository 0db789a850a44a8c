"""The state, lease and outbox tables, created with the DDL the SQLAlchemy recipe emits (same layout).

The outbox table (``kafka_transaction_outbox``) is used only with ``POOL_OPTIONS["retain_records"]``.
``python manage.py sqlmigrate kafka2pc 0001`` prints the SQL; reversed, the migration drops only the
tables that hold no row of another writer (see ``kafka2pc.recipes.django._migration``).
"""

from __future__ import annotations

from django.db import migrations, models
from kafka2pc.recipes.django._migration import CreateRecipeTables


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[CreateRecipeTables()],
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
