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
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING, Any

from django.db import connections

from ..dual_write import TransactionMisuseError

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = ["BlockGuards", "OtherAliasGuard", "StatementGuard"]


class _Leading:
    r"""Statements that begin with one of ``keywords``, alone or after a ``;`` (a multi-statement string).

    What ``re.search(r"(?:^|;)\s*(keywords)")`` finds, without running the
    pattern at every position of every statement the block sends: a match at
    the start, else (only for a string with a ``;``) the first one after a ``;``.
    """

    def __init__(self, keywords: str) -> None:
        self._start = re.compile(rf"\s*({keywords})", re.IGNORECASE)
        self._after_semicolon = re.compile(rf";\s*({keywords})", re.IGNORECASE)

    def search(self, sql: str) -> re.Match[str] | None:
        match = self._start.match(sql)
        if match is None and ";" in sql:
            match = self._after_semicolon.search(sql)
        return match


_ENDS_TRANSACTION = _Leading(
    r"COMMIT|END|ABORT|ROLLBACK(?!\s+(?:WORK\s+|TRANSACTION\s+)?TO\b)|BEGIN|START\s+TRANSACTION|"
    r"PREPARE\s+TRANSACTION|XA\s"
)
_COMMITS_IMPLICITLY_ON_MYSQL = _Leading(
    r"CREATE|ALTER|DROP|RENAME|TRUNCATE|LOCK\s+TABLES?|UNLOCK\s+TABLES?|"
    r"SET\s+(?:(?:SESSION|GLOBAL|@@SESSION\.|@@)\s*)?AUTOCOMMIT"
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
        self.alias = alias
        """The alias this guard is on."""
        self._block_alias = block_alias
        self.refused: str | None = None

    def error(self) -> TransactionMisuseError:
        return TransactionMisuseError(
            f"a {self.refused} on database {self.alias!r} inside `with dual_write(using={self._block_alias!r})` "
            f"would commit outside the two-phase commit (only database {self._block_alias!r} is in it). It was not "
            "sent; both sides of the block were rolled back. Write to the block's database, or write to "
            f"{self.alias!r} after the block (transaction.on_commit)"
        )

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        if isinstance(sql, str):
            match = _WRITES.match(sql)
            if match is not None:
                if self.refused is None:
                    self.refused = match.group(1).upper()
                raise self.error()
        return execute(sql, params, many, context)


class BlockGuards:
    """The execute wrappers of one block, in its thread: a :class:`StatementGuard` on the block's alias and an
    :class:`OtherAliasGuard` on every other alias of ``DATABASES``.

    A context manager that installs them on entry and removes them on exit.
    One object per block rather than one context manager per alias: it runs
    on every request.
    """

    def __init__(self, conn: BaseDatabaseWrapper) -> None:
        alias = conn.alias
        self._conn = conn
        self.statement = StatementGuard(conn.vendor, alias)
        self.others = [OtherAliasGuard(other, alias) for other in connections if other != alias]
        self._installed: AbstractContextManager[None] | None = None
        self._stack: ExitStack | None = None

    def __enter__(self) -> BlockGuards:
        installed = self._conn.execute_wrapper(self.statement)
        installed.__enter__()
        self._installed = installed
        if self.others:
            try:
                with ExitStack() as stack:
                    for guard in self.others:
                        stack.enter_context(connections[guard.alias].execute_wrapper(guard))
                    self._stack = stack.pop_all()  # entered: __exit__ closes it
            except BaseException:
                self.__exit__(*sys.exc_info())
                raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self._stack is not None:
                self._stack.close()
        finally:
            installed, self._stack, self._installed = self._installed, None, None
            if installed is not None:
                installed.__exit__(None, None, None)

    def refused(self) -> TransactionMisuseError | None:
        """The error of the first guard that refused a statement in the block (``None``: none did)."""
        if self.statement.refused is not None:
            return self.statement.error()
        for other in self.others:
            if other.refused is not None:
                return other.error()
        return None
