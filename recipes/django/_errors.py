"""SQLAlchemy's errors as Django's: the one place where the app translates them.

The dual write's pool speaks SQLAlchemy, so its database errors arrive as
``sqlalchemy.exc.*``, which ``except django.db.DatabaseError`` does not catch.
``dual_write()`` raises Django's class instead: the driver's exception
underneath (``.orig``) goes through the alias's ``wrap_database_errors``, as
Django's own cursors do (so ``OperationalError`` is ``django.db.OperationalError``,
a unique violation ``IntegrityError``, and Django marks the connection for its
end-of-request health check).  An error with no driver exception (SQLAlchemy's
own, e.g. a closed connection) becomes ``django.db.DatabaseError``.  The
SQLAlchemy error stays the ``__cause__``.
"""

from __future__ import annotations

import sqlalchemy as sa

__all__ = ["to_django"]


def to_django(exc: sa.exc.SQLAlchemyError, alias: str) -> Exception:
    """The ``django.db`` error for ``exc``, raised on database ``alias``."""
    from django.db import DatabaseError, connections

    orig = getattr(exc, "orig", None)
    if isinstance(exc, sa.exc.DBAPIError) and isinstance(orig, Exception):
        try:
            with connections[alias].wrap_database_errors:
                raise orig
        except Exception as translated:  # noqa: BLE001 - what Django made of it, whatever its class
            if translated is not orig:
                return translated
    error: Exception = DatabaseError(f"database {alias!r}: {exc}")
    return error
