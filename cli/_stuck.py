"""``find-hanging --older-than``: stuck transactions across the cluster, and the safe policy to abort them.

A transaction open longer than ``--older-than`` (coordinator view, every
broker) is *stuck*.  With ``--abort`` it is aborted (and its producer fenced,
as ``force-terminate`` does), but only after the known tables were asked:

* a transactional id whose row in the dual write's state table names the
  open transaction was *prepared and committed in the database*: aborting it
  would make a heuristic outcome, so it is refused, and the report says so
  (settle it with ``kafka2pc recover``, which commits it);
* an id in no state table (or whose stored state names another transaction,
  or none), leased or not, is aborted;
* a transaction already committing or aborting (``PrepareCommit``,
  ``PrepareAbort``) is left to its coordinator.

``--abort`` is a dry run unless ``--yes``; each decision is one audit line on
stderr (and on the ``kafka2pc.cli.audit`` logger, at WARNING).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import click

from ._render import format_duration, render_table
from ._stats import id_prefix

if TYPE_CHECKING:
    from kafka2pc import TransactionAdmin, TransactionInfo

__all__ = ["STUCK_HEADERS", "audit", "decide", "stuck_rows", "stuck_transactions"]

audit_log = logging.getLogger("kafka2pc.cli.audit")

REFUSED_REASON = (
    "the database committed this prepared transaction (its state row names it): aborting it would be a "
    "heuristic outcome; settle it with 'kafka2pc recover', which commits it"
)


def decide(info: TransactionInfo, stored_state: str | None, committed_in_db: bool, leased: bool) -> tuple[str, str]:
    """``(action, reason)`` for one stuck transaction: ``abort``, ``refuse`` or ``leave`` (pure policy)."""
    if info.state != "Ongoing":
        return "leave", f"{info.state}: its coordinator is ending it"
    if committed_in_db:
        return "refuse", REFUSED_REASON
    if stored_state:
        return "abort", "its state row names another transaction: the database did not commit this one"
    if leased:
        return "abort", "a leased id with no prepared state in the state table"
    return "abort", "in no state table"


def audit(action: str, entry: dict[str, Any]) -> None:
    """One audit line (stderr and the ``kafka2pc.cli.audit`` logger) for one decision."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    line = (
        f"audit {stamp} find-hanging {action} transactional_id={entry['transactional_id']!r} "
        f"producer={entry['producer_id']}/{entry['producer_epoch']} state={entry['state']} "
        f"open_for={format_duration(entry['open_for_ms'])} reason={entry['reason']!r}"
    )
    audit_log.warning("%s", line)
    click.echo(line, err=True)


def stuck_transactions(
    admin: TransactionAdmin,
    older_than_ms: int,
    *,
    states: dict[str, str | None],
    leased: set[str],
    abort: bool,
    dry_run: bool,
) -> list[dict[str, Any]]:
    """Plan (and unless ``dry_run``, carry out) the policy for every transaction open ``older_than_ms`` or more."""
    from kafka2pc import Decision, PreparedTxnState, UsageError

    entries = []
    for info in admin.list_transactions():
        if not info.is_open or info.open_for_ms < older_than_ms:
            continue
        stored = states.get(info.transactional_id)
        committed = False
        if stored:
            try:
                plan = admin.plan_recovery(info.transactional_id, PreparedTxnState(stored))
                committed = plan.decision is Decision.COMMIT
            except UsageError:
                stored = None  # malformed or another id's state: names nothing open here
        action, reason = decide(info, stored, committed, info.transactional_id in leased)
        desc = info.description
        entry: dict[str, Any] = {
            "transactional_id": info.transactional_id, "prefix": id_prefix(info.transactional_id),
            "state": info.state, "producer_id": desc.producer_id, "producer_epoch": desc.producer_epoch,
            "open_for_ms": info.open_for_ms, "held_back": sum(lag.held_back for lag in info.partitions),
            "stored_state": stored, "heuristic_if_aborted": committed, "action": action, "reason": reason,
        }
        if abort:
            if action == "abort" and not dry_run:
                before = admin.force_terminate_transaction(info.transactional_id, only_ongoing=True)
                entry["action"] = "aborted" if before is not None else "leave"
                if before is None:
                    entry["reason"] = "no longer Ongoing when aborted"
            elif action == "abort":
                entry["action"] = "would-abort"
            audit(entry["action"], entry)
        entries.append(entry)
    return entries


STUCK_HEADERS = ("TRANSACTIONAL ID", "STATE", "PRODUCER", "OPEN FOR", "HELD BACK", "ACTION", "REASON")


def stuck_rows(entries: list[dict[str, Any]]) -> str:
    """The entries as a table."""
    return render_table(STUCK_HEADERS, [
        (e["transactional_id"], e["state"], f"{e['producer_id']}/{e['producer_epoch']}",
         format_duration(e["open_for_ms"]), e["held_back"],
         e["action"].upper() + (" (HEURISTIC if aborted)" if e["heuristic_if_aborted"] else ""), e["reason"])
        for e in entries
    ])
