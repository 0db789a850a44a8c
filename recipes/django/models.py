"""The dual write's state and lease tables as Django models (read-only: the recipe writes them).

The tables are the SQLAlchemy recipe's own (``define_state_table``,
``define_lease_table``): the migration creates them with the DDL SQLAlchemy
emits for the database, so one database can serve both recipes and
``kafka2pc in-doubt`` / ``kafka2pc recover`` read them unchanged.  The models
exist for the admin page and for queries; write them only through the recipe.

Their timestamps are UTC in columns without a time zone (PostgreSQL's
``timestamp``, MySQL's ``DATETIME``), as the SQLAlchemy recipe writes them:
:class:`UTCDateTimeField` returns them aware (UTC) under ``USE_TZ``.
"""

from __future__ import annotations

import datetime
from typing import Any

from django.db import models


class UTCDateTimeField(models.DateTimeField):
    """A ``DateTimeField`` over a column without time zone that holds UTC: read back aware under ``USE_TZ``.

    Django's PostgreSQL backend returns such a column's values naive (it
    expects ``timestamp with time zone``); MySQL's and SQLite's make them
    aware themselves.  Migrations see a plain ``DateTimeField``.
    """

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        from django.conf import settings

        if isinstance(value, datetime.datetime) and value.tzinfo is None and settings.USE_TZ:
            return value.replace(tzinfo=datetime.timezone.utc)
        return value

    def deconstruct(self) -> Any:
        name, _path, args, kwargs = super().deconstruct()
        return name, "django.db.models.DateTimeField", args, kwargs


class TransactionState(models.Model):
    """One transactional id's row: the prepared state its last transaction (or recovery) stored."""

    transactional_id = models.CharField(max_length=255, primary_key=True)
    prepared_txn_state = models.CharField(max_length=255, null=True, blank=True)
    updated_at = UTCDateTimeField(null=True, blank=True)

    class Meta:
        db_table = "kafka_transaction_state"
        verbose_name = "transaction state"
        ordering = ["transactional_id"]

    def __str__(self) -> str:
        return f"{self.transactional_id}: {self.prepared_txn_state or '(empty)'}"


class WriterLease(models.Model):
    """One transactional id of a pool: who holds it, until when, and its fencing epoch."""

    transactional_id = models.CharField(max_length=255, primary_key=True)
    pool = models.CharField(max_length=255, db_index=True)
    owner = models.CharField(max_length=255, null=True, blank=True)
    expires_at = UTCDateTimeField(null=True, blank=True)
    epoch = models.BigIntegerField(default=0)

    class Meta:
        db_table = "kafka_writer_lease"
        verbose_name = "writer lease"
        ordering = ["transactional_id"]

    def __str__(self) -> str:
        return f"{self.transactional_id} ({self.owner or 'free'})"
