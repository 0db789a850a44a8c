from django.db import models


class Order(models.Model):
    """One order; its ``OrderPlaced`` event is produced in the same transaction as the row."""

    id = models.CharField(max_length=64, primary_key=True)
    item = models.CharField(max_length=200)
    quantity = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
