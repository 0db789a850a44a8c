"""The statements a dual write's block may not send through Django: they would end its transaction.

Django itself refuses ``transaction.commit()``, ``rollback()`` and
``set_autocommit()`` inside ``transaction.atomic`` (``TransactionManagementError``).
What it lets through is SQL: a raw ``COMMIT`` on a cursor would make the rows
written so far durable before Kafka is even prepared.  The guard is a Django
``execute_wrapper`` installed for the block: it refuses such a statement
before it is sent, and remembers it, so that the block fails and both sides
roll back even if the application catches the error.  On MySQL and MariaDB,
where DDL and ``SET autocommit`` commit implicitly, those are refused too.
Savepoints (``SAVEPOINT``, ``RELEASE``, ``ROLLBACK TO``, nested
``transaction.atomic``) are fine.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from ..dual_write import TransactionMisuseError

__all__ = ["OtherAliasGuard", "StatementGuard", "guard_other_aliases"]

_ENDS_TRANSACTION = re.compile(
    r"(?:^|;)\s*(COMMIT|END|ABORT|ROLLBACK(?!\s+(?:WORK\s+|TRANSACTION\s+)?TO\b)|BEGIN|START\s+TRANSACTION|"
    r"PREPARE\s+TRANSACTION|XA\s)",
    re.IGNORECASE,
)
_COMMITS_IMPLICITLY_ON_MYSQL = re.compile(
    r"(?:^|;)\s*(CREATE|ALTER|DROP|RENAME|TRUNCATE|LOCK\s+TABLES?|UNLOCK\s+TABLES?|"
    r"SET\s+(?:(?:SESSION|GLOBAL|@@SESSION\.|@@)\s*)?AUTOCOMMIT)",
    re.IGNORECASE,
)


class StatementGuard:
    """An ``execute_wrapper`` refusing statements that end or implicitly commit the block's transaction."""

    def __init__(self, vendor: str, alias: str) -> None:
        self._patterns = [_ENDS_TRANSACTION] + ([_COMMITS_IMPLICITLY_ON_MYSQL] if vendor == "mysql" else [])
        self._alias = alias
        self.refused: str | None = None
        """The first statement refused (the block fails with :meth:`error` even if its error was caught)."""

    def error(self) -> TransactionMisuseError:
        return TransactionMisuseError(
            f"database {self._alias!r}: the statement {self.refused!r} would end the transaction of "
            "`with dual_write()`, which commits together with the Kafka transaction. It was not sent; "
            "both sides were rolled back (nothing of this transaction is kept). Use savepoints "
            "(a nested transaction.atomic()) instead"
        )

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        if isinstance(sql, str):
            for pattern in self._patterns:
                match = pattern.search(sql)
                if match is not None:
                    if self.refused is None:
                        self.refused = match.group(1).upper()
                    raise self.error()
        return execute(sql, params, many, context)


_WRITES = re.compile(
    r"^\s*(?:/\*.*?\*/\s*)*(INSERT|UPDATE|DELETE|REPLACE|MERGE|UPSERT|TRUNCATE|COPY|CREATE|ALTER|DROP|RENAME|GRANT|REVOKE)\b",
    re.IGNORECASE | re.DOTALL,
)


class OtherAliasGuard:
    """An ``execute_wrapper`` on the *other* database aliases, in the block's thread, while the block runs.

    A write there (a database router sending ``save()`` elsewhere, a
    ``using="other"``) would commit on its own, outside the two-phase commit,
    and survive a rollback of the block.  It is refused before it is sent,
    and remembered, so that the block fails even if the application caught the
    error.  Reads go through.
    """

    def __init__(self, alias: str, block_alias: str) -> None:
        self._alias = alias
        self._block_alias = block_alias
        self.refused: str | None = None

    def error(self) -> TransactionMisuseError:
        return TransactionMisuseError(
            f"a {self.refused} on database {self._alias!r} inside `with dual_write(using={self._block_alias!r})` "
            f"would commit outside the two-phase commit (only database {self._block_alias!r} is in it). It was not "
            "sent; both sides of the block were rolled back. Write to the block's database, or write to "
            f"{self._alias!r} after the block (transaction.on_commit)"
        )

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        if isinstance(sql, str):
            match = _WRITES.match(sql)
            if match is not None:
                if self.refused is None:
                    self.refused = match.group(1).upper()
                raise self.error()
        return execute(sql, params, many, context)


@contextmanager
def guard_other_aliases(block_alias: str) -> Iterator[list[OtherAliasGuard]]:
    """:class:`OtherAliasGuard` on every alias of ``DATABASES`` but ``block_alias``, in this thread."""
    from django.db import connections

    guards = [OtherAliasGuard(alias, block_alias) for alias in connections if alias != block_alias]
    with ExitStack() as stack:
        for guard in guards:
            stack.enter_context(connections[guard._alias].execute_wrapper(guard))
        yield guards
