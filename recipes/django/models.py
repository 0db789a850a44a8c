"""The dual write's state and lease tables as Django models (read-only: the recipe writes them).

The tables are the SQLAlchemy recipe's own (``define_state_table``,
``define_lease_table``): the migration creates them with the DDL SQLAlchemy
emits for the database, so one database can serve both recipes and
``kafka2pc in-doubt`` / ``kafka2pc recover`` read them unchanged.  The models
exist for the admin page and for queries; write them only through the recipe.
"""

from __future__ import annotations

from django.db import models


class TransactionState(models.Model):
    """One transactional id's row: the prepared state its last transaction (or recovery) stored."""

    transactional_id = models.CharField(max_length=255, primary_key=True)
    prepared_txn_state = models.CharField(max_length=255, null=True, blank=True)
    updated_at = models.DateTimeField(null=True, blank=True)

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
    expires_at = models.DateTimeField(null=True, blank=True)
    epoch = models.BigIntegerField(default=0)

    class Meta:
        db_table = "kafka_writer_lease"
        verbose_name = "writer lease"
        ordering = ["transactional_id"]

    def __str__(self) -> str:
        return f"{self.transactional_id} ({self.owner or 'free'})"
