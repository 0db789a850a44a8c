"""``python manage.py kafka2pc_recover``: settle what dead workers left (deploy hooks, cron)."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser


class Command(BaseCommand):
    help = ("Settle the dual write's transactions that dead workers left open: every id of the pool whose "
            "lease expired (with --wait, also those that expire within that many seconds). Exit code 1 if "
            "a recovery failed or found a heuristic outcome.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", action="append", dest="databases", metavar="ALIAS",
                            help="Database alias (repeatable; default: default).")
        parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                            help="Also wait up to this long for leases other instances hold to expire.")
        parser.add_argument("--json", action="store_true", help="One JSON document on stdout.")

    def handle(self, *args: Any, **options: Any) -> None:
        from ..._recover import recover
        from ..._runtime import close_all

        try:
            results = recover(options["databases"] or None, wait_s=options["wait"])
        finally:
            close_all()
        entries = [{
            "transactional_id": r.transactional_id,
            "stored_state": str(r.stored_state),
            "decision": r.settlement.plan.decision.value if r.settlement is not None else None,
            "heuristic": r.heuristic,
            "error": None if r.error is None else str(r.error),
        } for r in results]
        if options["json"]:
            self.stdout.write(json.dumps({"settled": entries}))
        else:
            for e in entries:
                flags = (" HEURISTIC" if e["heuristic"] else "") + (f" error: {e['error']}" if e["error"] else "")
                self.stdout.write(f"{e['transactional_id']}: stored {e['stored_state']} -> {e['decision']}{flags}")
            self.stdout.write(f"{len(entries)} id(s) settled")
        if any(not r.ok for r in results):
            raise CommandError("a recovery failed or found a heuristic outcome (see above)", returncode=1)
