"""Exit codes, and the one place where errors become (exit code, one-line message).

Operators script around the exit code, so each failure a person must handle
differently has its own code; the message says what to do.  Every exception a
command lets escape goes through :func:`classify`, called from one place (the
group's ``invoke`` in :mod:`kafka2pc.cli`).

Only cheap modules are imported here: ``kafka2pc`` itself (its exceptions) is pure
Python.  SQLAlchemy's error classes are recognised by module name, so that
``kafka2pc --help`` never imports SQLAlchemy.
"""

from __future__ import annotations

import enum

from kafka2pc import (
    AuthorizationError,
    BrokerUnavailableError,
    HeuristicOutcomeError,
    IndefiniteOutcomeError,
    Kafka2pcError,
    RetriableError,
    UnsupportedBrokerError,
    UsageError,
)

__all__ = ["CliFailure", "ExitCode", "classify", "error_json"]


class ExitCode(enum.IntEnum):
    """The CLI's exit codes (documented in ``docs/cli.md``; never renumber them)."""

    OK = 0
    FAILURE = 1
    """The command did not complete for a reason not listed below (operator declined,
    a row that could not be handled, an unexpected Kafka error)."""
    USAGE = 2
    """Bad command line, malformed ``--command-config`` file or prepared state (click's code)."""
    HEURISTIC = 3
    """A heuristic outcome was found: Kafka aborted a transaction the database committed."""
    NOT_FOUND = 4
    """The transactional id is unknown to the cluster."""
    UNREACHABLE = 5
    """No broker (or transaction coordinator) answered within ``--timeout``."""
    AUTHORIZATION = 6
    """Authentication failed, or the principal lacks an ACL."""
    DATABASE = 7
    """The state database cannot be reached or read."""
    UNSUPPORTED = 8
    """The broker lacks an API the command needs."""
    INDEFINITE = 9
    """A commit/abort got no answer: its outcome is not known yet; run the command again."""
    ATTENTION = 10
    """Done as asked, with items left for a person (``stuck --abort --yes`` refused to abort a
    transaction the database committed: settle it with ``recover``).  Not a failure."""


class CliFailure(Exception):
    """Raised by commands for failures they detect themselves (e.g. an unknown id)."""

    def __init__(self, message: str, exit_code: ExitCode) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _is_sqlalchemy_error(exc: BaseException) -> bool:
    return any(cls.__module__.startswith("sqlalchemy") for cls in type(exc).__mro__)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def classify(exc: BaseException) -> tuple[ExitCode, str]:
    """The exit code and the one-line message for an exception a command raised."""
    if isinstance(exc, CliFailure):
        return exc.exit_code, _one_line(str(exc))
    if isinstance(exc, AuthorizationError):
        return ExitCode.AUTHORIZATION, (
            f"authorization failed: {_one_line(str(exc))} "
            "(check the credentials in --command-config and the principal's ACLs)"
        )
    if isinstance(exc, BrokerUnavailableError):
        return ExitCode.UNREACHABLE, (
            f"Kafka unreachable: {_one_line(str(exc))} "
            "(check --bootstrap-server, the network and security.protocol; raise --timeout if the cluster is slow)"
        )
    if isinstance(exc, RetriableError):
        return ExitCode.UNREACHABLE, f"the cluster did not settle in time: {_one_line(str(exc))} (try again)"
    if isinstance(exc, UnsupportedBrokerError):
        return ExitCode.UNSUPPORTED, f"unsupported by the broker: {_one_line(str(exc))}"
    if isinstance(exc, HeuristicOutcomeError):
        return ExitCode.HEURISTIC, f"HEURISTIC OUTCOME: {_one_line(str(exc))}"
    if isinstance(exc, IndefiniteOutcomeError):
        return ExitCode.INDEFINITE, f"outcome not known yet: {_one_line(str(exc))} (run the command again)"
    if isinstance(exc, UsageError):
        return ExitCode.USAGE, _one_line(str(exc))
    if isinstance(exc, Kafka2pcError):
        return ExitCode.FAILURE, f"Kafka error: {_one_line(str(exc))}"
    if _is_sqlalchemy_error(exc):
        detail = _one_line(str(getattr(exc, "orig", None) or exc).split("\n(Background", 1)[0])
        return ExitCode.DATABASE, f"database error: {type(exc).__name__}: {detail}"
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.FAILURE, "interrupted"
    return ExitCode.FAILURE, f"unexpected error: {type(exc).__name__}: {_one_line(str(exc))} (run with --debug)"


def error_json(exit_code: int, message: str) -> dict[str, object]:
    """The JSON document of a failed command run with ``-o json`` (schema ``error`` in ``docs/cli.md``)."""
    try:
        name = ExitCode(exit_code).name
    except ValueError:
        name = "FAILURE"
    return {"version": 1, "error": {"exit_code": int(exit_code), "name": name, "message": _one_line(message)}}
