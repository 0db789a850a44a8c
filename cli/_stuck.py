"""``kafka2pc stuck``: stuck transactions across the cluster, and the safe policy to abort them.

A transaction open longer than ``--older-than`` (coordinator view, every
broker) is *stuck* (``find-hanging --older-than`` is the deprecated
spelling).  With ``--abort`` it is aborted (and its producer fenced, as
``force-terminate`` does), but only after the known tables were asked:

* a transactional id whose row in the dual write's state table names the
  open transaction was *prepared and committed in the database*: aborting it
  would make a heuristic outcome, so it is refused, and the report says so
  (settle it with ``kafka2pc recover``, which commits it);
* an id in no state table (or whose stored state names another transaction,
  or none), leased or not, is aborted;
* a transaction already committing or aborting (``PrepareCommit``,
  ``PrepareAbort``) is left to its coordinator.

``--abort`` is a dry run unless ``--yes``; each decision is one audit line on
stderr (and on the ``kafka2pc.cli.audit`` logger, at WARNING).  With ``--yes``,
a refusal ends the command with exit code 10 (``ATTENTION``): done as asked,
with items for a person.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import click

from ._errors import ExitCode
from ._group import cli
from ._options import DEFAULT_STATE_TABLE, DURATION, connection_options, current_settings, open_admin, output_option
from ._render import JSON_VERSION, dump_json, format_duration, info_open_ms, render_table
from ._stats import id_prefix

if TYPE_CHECKING:
    from kafka2pc import TransactionAdmin, TransactionInfo

__all__ = ["STUCK_HEADERS", "audit", "decide", "run_stuck", "stuck_rows", "stuck_transactions"]

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
        f"audit {stamp} stuck {action} transactional_id={entry['transactional_id']!r} "
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
        if not info.is_open or info_open_ms(info) < older_than_ms:
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
            "open_for_ms": info_open_ms(info), "held_back": sum(lag.held_back for lag in info.partitions),
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


@cli.command("stuck")
@click.option("--older-than", "older_than_s", type=DURATION, required=True, metavar="DURATION",
              help="A transaction open at least this long is stuck (coordinator view, cluster-wide; 30m, 1h).")
@click.option("--abort", "abort", is_flag=True,
              help="Abort the stuck ones (dry run unless --yes), except those the database committed.")
@click.option("--yes", "-y", is_flag=True, help="With --abort: really abort.")
@click.option("--db-url", metavar="URL", envvar="KAFKA2PC_DB_URL",
              help="SQLAlchemy URL of the database holding the dual write's state table [env: KAFKA2PC_DB_URL].")
@click.option("--table", default=DEFAULT_STATE_TABLE, show_default=True, metavar="NAME",
              help="The dual write's state table (schema.table allowed).")
@click.option("--lease-table", metavar="NAME", help="A WriterPool's lease table, if any (schema.table allowed).")
@click.option("--no-db", is_flag=True, help="With --abort: no state table to check (every stuck id is aborted).")
@output_option
@connection_options(group=False)
def stuck_command(
    older_than_s: float, abort: bool, yes: bool, db_url: str | None, table: str, lease_table: str | None,
    no_db: bool, output: str,
) -> None:
    """Transactions open at least --older-than, and the safe policy to abort them.

    A transaction its coordinator still has open (a prepared transaction of
    an owner that died, a producer that stopped mid-transaction) is stuck
    once it is that old.  Add --abort to abort them (and fence their
    producers): a dry run unless --yes.  An id whose row in the state table
    (--db-url, --table) names the open transaction was committed by the
    database: it is never aborted (that would be a heuristic outcome); the
    report says so, 'kafka2pc recover' commits it, and the command ends with
    exit code 10.  One audit line per decision on stderr.  (A partition held
    back by a transaction no coordinator has open is not stuck but hanging:
    see find-hanging and abort.)
    """
    run_stuck(older_than_s, abort=abort, yes=yes, db_url=db_url, table=table, lease_table=lease_table,
              no_db=no_db, output=output, command="stuck")


def run_stuck(
    older_than_s: float, *, abort: bool, yes: bool, db_url: str | None, table: str, lease_table: str | None,
    no_db: bool, output: str, command: str,
) -> None:
    """``stuck`` (and its deprecated spelling ``find-hanging --older-than``): report, and with --abort, act."""
    if (yes or no_db) and not abort and command == "stuck":
        raise click.UsageError("--yes and --no-db go with --abort")
    if abort and db_url is None and not no_db:
        raise click.UsageError(
            "--abort needs --db-url (the state table says which transactions the database committed); "
            "--no-db aborts without that check"
        )
    older_than_ms = round(older_than_s * 1000)
    timeout_s = current_settings().timeout_s
    states: dict[str, str | None] = {}
    leased: set[str] = set()
    if db_url is not None:
        from ._statedb import read_ids, read_states

        states = {row.transactional_id: row.prepared_txn_state
                  for row in read_states(db_url, table, timeout_s=timeout_s)}
        if lease_table is not None:
            leased = read_ids(db_url, lease_table, timeout_s=timeout_s)
    with open_admin() as admin:
        entries = stuck_transactions(admin, older_than_ms, states=states, leased=leased, abort=abort,
                                     dry_run=not yes)
    refused = sum(e["action"] == "refuse" for e in entries)
    if output == "json":
        click.echo(dump_json({
            "version": JSON_VERSION, "command": command, "older_than_ms": older_than_ms,
            "abort": abort, "dry_run": abort and not yes, "transactions": entries,
        }))
    elif not entries:
        click.echo(f"no transaction open {format_duration(older_than_ms)} or longer")
    else:
        click.echo(stuck_rows(entries))
        if abort and not yes:
            click.echo("dry run: nothing was aborted (pass --yes to abort the WOULD-ABORT ones)")
        if refused:
            click.echo(f"HEURISTIC if aborted: {refused} transaction(s) the database committed were not aborted; "
                       "settle them with 'kafka2pc recover'")
    if abort and yes and refused:
        click.get_current_context().exit(int(ExitCode.ATTENTION))
