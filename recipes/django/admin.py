"""A read-only admin page of the stored prepared states and of the pool's leases, for every database alias.

A row whose ``prepared_txn_state`` is set names the last transaction of its
id that the database committed; if that id's lease expired (its worker died)
the transaction may still be prepared in Kafka, waiting for a survivor's
recovery.  ``kafka2pc in-doubt`` joins these rows with the coordinator's view.

Each page lists one database alias at a time (the "database" filter: every
alias of ``DATABASES``, default ``default``), in one query per page: the lease
columns of the state page are a subquery, not a query per row.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import OuterRef, Subquery
from django.http import HttpRequest

from .models import TransactionState, WriterLease


class DatabaseFilter(admin.SimpleListFilter):
    """The database alias whose rows the page lists (every alias of ``DATABASES``)."""

    title = "database"
    parameter_name = "database"

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        from django.db import connections

        return [(alias, alias) for alias in connections]

    def queryset(self, request: Any, queryset: Any) -> Any:
        return queryset  # applied in get_queryset, before the other filters

    def choices(self, changelist: Any) -> Any:
        current = self.value() or "default"
        for lookup, title in self.lookup_choices:
            yield {"selected": current == lookup, "display": title,
                   "query_string": changelist.get_query_string({self.parameter_name: lookup})}


def _rows_of_chosen_alias(model_admin: admin.ModelAdmin[Any], request: HttpRequest) -> Any:
    """The model's rows on the database alias the "database" filter chose (``default`` if none)."""
    return admin.ModelAdmin.get_queryset(model_admin, request).using(
        request.GET.get(DatabaseFilter.parameter_name) or "default")


def _refused(model_admin: admin.ModelAdmin[Any], request: HttpRequest, obj: Any = None) -> bool:
    """Read-only pages: no add, change or delete."""
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
class TransactionStateAdmin(admin.ModelAdmin):
    list_display = ("transactional_id", "prepared_txn_state", "updated_at", "lease_owner", "lease_expires_at")
    list_filter = (DatabaseFilter, StoredStateFilter)
    search_fields = ("transactional_id",)

    has_add_permission = has_change_permission = has_delete_permission = _refused

    def get_queryset(self, request: HttpRequest) -> Any:
        leases = WriterLease.objects.filter(transactional_id=OuterRef("transactional_id"))
        return _rows_of_chosen_alias(self, request).annotate(
            _lease_owner=Subquery(leases.values("owner")[:1]),
            _lease_expires_at=Subquery(leases.values("expires_at")[:1]),
            _leased=Subquery(leases.values("transactional_id")[:1]),
        )

    def lease_owner(self, obj: Any) -> str:
        if obj._leased is None:
            return "-"
        return str(obj._lease_owner or "free")

    def lease_expires_at(self, obj: Any) -> Any:
        return obj._lease_expires_at

    lease_owner.short_description = "lease owner"  # type: ignore[attr-defined]
    lease_expires_at.short_description = "lease expires (UTC)"  # type: ignore[attr-defined]


@admin.register(WriterLease)
class WriterLeaseAdmin(admin.ModelAdmin):
    list_display = ("transactional_id", "pool", "owner", "expires_at", "epoch")
    list_filter = (DatabaseFilter, "pool")
    search_fields = ("transactional_id", "owner")
    has_add_permission = has_change_permission = has_delete_permission = _refused

    def get_queryset(self, request: HttpRequest) -> Any:
        return _rows_of_chosen_alias(self, request)
