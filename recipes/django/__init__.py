"""A reusable Django app: Django's ORM and Kafka in one two-phase commit, on the dual write's protocol.

::

    # settings.py
    INSTALLED_APPS += ["kafka2pc.recipes.django"]
    KAFKA2PC = {
        "PRODUCER": {"bootstrap.servers": "kafka:9092"},
        "TRANSACTIONAL_ID_PREFIX": "orders",
        "POOL_SIZE": 16,
    }

    # python manage.py migrate kafka2pc

    # a view
    from kafka2pc.recipes.django import dual_write

    with dual_write() as tx:
        order = Order.objects.create(sku="book")
        tx.produce("orders", key=str(order.pk), value=b"created")

The rows and the records commit together or not at all.  The block is the
outermost ``transaction.atomic`` of its alias; inside, the dual write's
:class:`~kafka2pc.recipes.dual_write.WriterPool` runs its transaction on a
SQLAlchemy connection that is Django's own connection, so the state row, the
claims, the leases and the recovery are the SQLAlchemy recipe's, unchanged,
on the same tables (``docs/django.md`` explains the design).

Call :func:`recover` at worker start (gunicorn ``post_worker_init``, the
ASGI module of uvicorn or daphne: ``docs/django.md``); ``python manage.py kafka2pc_recover`` does the same for deploy
hooks and cron.
"""

from typing import TYPE_CHECKING, Any

from kafka2pc._extras import missing_extra

try:
    import django  # noqa: F401
    import sqlalchemy  # noqa: F401
except ImportError as exc:
    raise missing_extra(exc, extra="django", feature="kafka2pc.recipes.django") from exc

__all__ = [
    "AsyncDualWriteTransaction",
    "ConfigurationError",
    "MigrationMissingError",
    "NestedAtomicError",
    "adual_write",
    "close",
    "dual_write",
    "recover",
]

_LAZY = {
    "AsyncDualWriteTransaction": "._write",
    "NestedAtomicError": "._write",
    "adual_write": "._write",
    "dual_write": "._write",
    "recover": "._recover",
    "MigrationMissingError": "._runtime",
    "close": "._runtime",
    "ConfigurationError": "._settings",
}

if TYPE_CHECKING:
    from ._recover import recover
    from ._runtime import MigrationMissingError, close
    from ._settings import ConfigurationError
    from ._write import AsyncDualWriteTransaction, NestedAtomicError, adual_write, dual_write
else:

    def __getattr__(name: str) -> Any:
        # Lazy: INSTALLED_APPS imports this package before Django's settings and apps are ready.
        if name == "AsyncDualWrite":  # its 1.0 name
            from kafka2pc._deprecation import renamed

            renamed("kafka2pc.recipes.django.AsyncDualWrite", "kafka2pc.recipes.django.AsyncDualWriteTransaction")
            name = "AsyncDualWriteTransaction"
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # the deprecated name is never cached: each access warns
        return value
