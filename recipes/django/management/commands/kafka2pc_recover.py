"""``python manage.py kafka2pc_recover``: settle what dead workers left (deploy hooks, cron).

Exit codes are the CLI's (``kafka2pc.cli.ExitCode``, ``docs/cli.md``), so one script handles both:

====  ===========  ================================================================
code  name         meaning
====  ===========  ================================================================
0     OK           done; nothing needs a person
1     FAILURE      a recovery failed (its id is left for the next run)
2     USAGE        a bad option or setting (``KAFKA2PC``, an unknown alias)
3     HEURISTIC    a heuristic outcome: Kafka aborted a transaction the database committed
5     UNREACHABLE  Kafka did not answer in time
7     DATABASE     the database cannot be reached or read, or the app's migration is missing
9     INDEFINITE   an outcome is not known yet: run the command again
====  ===========  ================================================================

Every error is one line on stderr (``--json``: one JSON document on stdout, with an ``error`` member).
``--dry-run`` lists the ids in doubt (those whose stored state names a transaction Kafka still holds
open) with the decision a recovery would take, and settles nothing.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

#: The CLI's exit codes (``kafka2pc.cli.ExitCode``; a test checks they agree).
EXIT_CODES = {"OK": 0, "FAILURE": 1, "USAGE": 2, "HEURISTIC": 3, "UNREACHABLE": 5, "DATABASE": 7, "INDEFINITE": 9}


def _one_line(text: object) -> str:
    return " ".join(str(text).split("\n(Background", 1)[0].split())


def classify(exc: BaseException) -> tuple[str, str]:
    """The exit code's name and the one-line message for an error that stopped the command."""
    from django.core.exceptions import ImproperlyConfigured
    from django.db import Error as DjangoDatabaseError

    from kafka2pc import (
        BrokerUnavailableError,
        HeuristicOutcomeError,
        IndefiniteOutcomeError,
        Kafka2pcError,
        RetriableError,
        UsageError,
    )

    from ....dual_write import MissingTableError

    if isinstance(exc, MissingTableError):
        return "DATABASE", f"migration missing: {_one_line(exc)}"
    if isinstance(exc, HeuristicOutcomeError):
        return "HEURISTIC", f"HEURISTIC OUTCOME: {_one_line(exc)}"
    if isinstance(exc, IndefiniteOutcomeError):
        return "INDEFINITE", f"outcome not known yet: {_one_line(exc)} (run the command again)"
    if isinstance(exc, (BrokerUnavailableError, RetriableError)):
        return "UNREACHABLE", f"Kafka unreachable: {_one_line(exc)} (check KAFKA2PC['PRODUCER'] and the network)"
    if isinstance(exc, (UsageError, ImproperlyConfigured)):
        return "USAGE", _one_line(exc)
    if isinstance(exc, Kafka2pcError):
        return "FAILURE", f"Kafka error: {_one_line(exc)}"
    if isinstance(exc, DjangoDatabaseError) or any(c.__module__.startswith("sqlalchemy") for c in type(exc).__mro__):
        detail = getattr(exc, "orig", None) or exc
        return "DATABASE", f"database error: {type(exc).__name__}: {_one_line(detail)}"
    return "FAILURE", f"unexpected error: {type(exc).__name__}: {_one_line(exc)}"


class Command(BaseCommand):
    help = ("Settle the dual write's transactions that dead workers left open: every id of the pool whose "
            "lease expired (with --wait, also those that expire within that many seconds). --dry-run lists "
            "the ids in doubt without settling them. Exit codes are the kafka2pc CLI's: 3 heuristic outcome, "
            "1 a recovery failed, 7 database or migration, 5 Kafka unreachable, 9 outcome not known yet.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", action="append", dest="databases", metavar="ALIAS",
                            help="Database alias (repeatable; default: default).")
        parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                            help="Also wait up to this long for leases other instances hold to expire.")
        parser.add_argument("--dry-run", action="store_true",
                            help="List the ids in doubt and what a recovery would decide; settle nothing.")
        parser.add_argument("--json", action="store_true", help="One JSON document on stdout.")

    def handle(self, *args: Any, **options: Any) -> None:
        from ..._runtime import close_all

        aliases: list[str] = options["databases"] or ["default"]
        try:
            try:
                if options["dry_run"]:
                    entries = [entry for alias in aliases for entry in _in_doubt(alias)]
                    code = "HEURISTIC" if any(e["heuristic"] for e in entries) else "OK"
                else:
                    entries, code = _settle(aliases, options["wait"])
            finally:
                close_all()
        except Exception as exc:  # noqa: BLE001 - every error becomes one line and an exit code
            name, message = classify(exc)
            if options["json"]:
                self.stdout.write(json.dumps({"version": 1, "dry_run": options["dry_run"], "error": {
                    "exit_code": EXIT_CODES[name], "name": name, "message": message}}))
            else:
                self.stderr.write(f"kafka2pc_recover: {message}")
            sys.exit(EXIT_CODES[name])
        if options["json"]:
            key = "in_doubt" if options["dry_run"] else "settled"
            self.stdout.write(json.dumps({"version": 1, "dry_run": options["dry_run"], key: entries,
                                          "exit_code": EXIT_CODES[code], "name": code}))
        else:
            for e in entries:
                flags = (" HEURISTIC" if e["heuristic"] else "") + (f" error: {e['error']}" if e["error"] else "")
                self.stdout.write(f"{e['transactional_id']}: stored {e['stored_state']} -> {e['decision']}{flags}")
            verb = "in doubt (nothing settled: --dry-run)" if options["dry_run"] else "settled"
            self.stdout.write(f"{len(entries)} id(s) {verb}")
        if code != "OK":
            sys.exit(EXIT_CODES[code])


def _settle(aliases: list[str], wait_s: float) -> tuple[list[dict[str, Any]], str]:
    from kafka2pc import IndefiniteOutcomeError

    from ..._recover import recover

    results = recover(aliases, wait_s=wait_s)
    entries = [{
        "transactional_id": r.transactional_id,
        "stored_state": str(r.stored_state),
        "decision": r.settlement.plan.decision.value if r.settlement is not None else None,
        "heuristic": r.heuristic,
        "error": None if r.error is None else _one_line(r.error),
    } for r in results]
    if any(r.heuristic for r in results):
        return entries, "HEURISTIC"
    if any(isinstance(r.error, IndefiniteOutcomeError) for r in results):
        return entries, "INDEFINITE"
    if any(not r.ok for r in results):
        return entries, "FAILURE"
    return entries, "OK"


def _in_doubt(alias: str) -> list[dict[str, Any]]:
    """The ids of ``alias``'s pool whose stored state names a transaction Kafka holds open; nothing settled."""
    from kafka2pc import PreparedTxnState, TransactionAdmin

    from ..._runtime import DEFAULT_KAFKA_TIMEOUT_S, runtime_for
    from ...models import TransactionState, WriterLease

    runtime = runtime_for(alias, start=False)  # the pool's tables checked; no background thread, no lease taken
    leases = {lease.transactional_id: lease for lease in
              WriterLease.objects.using(alias).filter(pool=runtime.pool.prefix)}
    states = TransactionState.objects.using(alias).filter(transactional_id__in=list(leases)).exclude(
        prepared_txn_state=None).exclude(prepared_txn_state="")
    entries: list[dict[str, Any]] = []
    timeout_s = float(runtime.settings.pool_options.get("kafka_timeout_s") or DEFAULT_KAFKA_TIMEOUT_S)
    with TransactionAdmin(runtime.settings.producer, timeout_s=timeout_s) as admin:  # each call: kafka_timeout_s
        for row in states:
            plan = admin.plan_recovery(row.transactional_id, PreparedTxnState(row.prepared_txn_state))
            if plan.decision.value == "nothing" and not plan.heuristic:
                continue
            lease = leases[row.transactional_id]
            entries.append({
                "transactional_id": row.transactional_id, "database": alias,
                "stored_state": row.prepared_txn_state, "decision": plan.decision.value,
                "heuristic": plan.heuristic, "reason": plan.reason, "owner": lease.owner,
                "lease_expires_at": None if lease.expires_at is None else lease.expires_at.isoformat(),
                "error": None,
            })
    return entries
