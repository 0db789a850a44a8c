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
from collections.abc import Callable
from typing import Any

from ..dual_write import TransactionMisuseError

__all__ = ["StatementGuard"]

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
