"""A read-only admin page of the stored prepared states and of the pool's leases.

A row whose ``prepared_txn_state`` is set names the last transaction of its
id that the database committed; if that id's lease expired (its worker died)
the transaction may still be prepared in Kafka, waiting for a survivor's
recovery.  ``kafka2pc in-doubt`` joins these rows with the coordinator's view.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from .models import TransactionState, WriterLease


class _ReadOnly(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class StoredStateFilter(admin.SimpleListFilter):
    """Rows with a stored prepared state (a transaction the database committed) or without."""

    title = "stored state"
    parameter_name = "stored"

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "prepared state stored"), ("no", "empty")]

    def queryset(self, request: Any, queryset: Any) -> Any:
        if self.value() == "yes":
            return queryset.exclude(prepared_txn_state__isnull=True).exclude(prepared_txn_state="")
        if self.value() == "no":
            return queryset.filter(prepared_txn_state__isnull=True) | queryset.filter(prepared_txn_state="")
        return queryset


@admin.register(TransactionState)
class TransactionStateAdmin(_ReadOnly):
    list_display = ("transactional_id", "prepared_txn_state", "updated_at", "lease_owner", "lease_expires_at")
    list_filter = (StoredStateFilter,)
    search_fields = ("transactional_id",)

    def _lease(self, obj: TransactionState) -> Any:
        return WriterLease.objects.using(obj._state.db).filter(transactional_id=obj.transactional_id).first()

    def lease_owner(self, obj: TransactionState) -> str:
        lease = self._lease(obj)
        return "-" if lease is None else str(lease.owner or "free")

    def lease_expires_at(self, obj: TransactionState) -> Any:
        lease = self._lease(obj)
        return None if lease is None else lease.expires_at

    lease_owner.short_description = "lease owner"  # type: ignore[attr-defined]
    lease_expires_at.short_description = "lease expires (UTC)"  # type: ignore[attr-defined]


@admin.register(WriterLease)
class WriterLeaseAdmin(_ReadOnly):
    list_display = ("transactional_id", "pool", "owner", "expires_at", "epoch")
    list_filter = ("pool",)
    search_fields = ("transactional_id", "owner")
