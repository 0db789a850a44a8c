"""The application table of the Django tests (the crash matrix's ``dw_items`` layout: id, series)."""

from __future__ import annotations

from django.db import models


class Item(models.Model):
    id = models.CharField(max_length=100, primary_key=True)
    series = models.CharField(max_length=64, db_index=True)

    class Meta:
        db_table = "dw_items"
        app_label = "djtest"
