"""``in-doubt`` and ``recover``: the dual write's stored prepared states, joined with the coordinator's view."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ._errors import ExitCode
from ._group import cli
from ._options import (
    DEFAULT_STATE_TABLE,
    configure_logging,
    connection_options,
    current_settings,
    open_admin,
    output_option,
)
from ._render import JSON_VERSION, dump_json, format_duration, open_for_ms, render_table
from ._stats import dump_json_line, watch, watch_options

if TYPE_CHECKING:
    from kafka2pc import TransactionDescription

    from ._statedb import StoredState

__all__: list[str] = []

_F = TypeVar("_F", bound=Callable[..., Any])


def _db_options(func: _F) -> _F:
    func = click.option(
        "--transactional-id", "transactional_ids", multiple=True, metavar="ID",
        help="Only this transactional id's row (repeatable); a named id without a row is an error.",
    )(func)
    func = click.option(
        "--table", default=DEFAULT_STATE_TABLE, show_default=True, metavar="NAME",
        help="The recipe's state table (schema.table allowed).",
    )(func)
    return click.option(
        "--db-url", required=True, metavar="URL", envvar="KAFKA2PC_DB_URL", show_envvar=True,
        help="SQLAlchemy URL of the database holding the prepared states.",
    )(func)


def _fill_kafka_fields(entry: dict[str, Any], desc: TransactionDescription | None) -> None:
    if desc is not None:
        entry.update(
            kafka_state=desc.state, producer_id=desc.producer_id, producer_epoch=desc.producer_epoch,
            open_for_ms=open_for_ms(desc),
        )


_ENTRY_FIELDS = (
    "transactional_id", "stored_state", "updated_at", "kafka_state", "producer_id", "producer_epoch",
    "open_for_ms", "decision", "heuristic", "stored_outcome", "outcome", "reason", "error",
)
"""The fields of one entry of ``in-doubt`` / ``recover`` JSON output, in order."""


def _report(
    *, settle: bool, dry_run: bool, db_url: str, table: str, transactional_ids: tuple[str, ...] = ()
) -> tuple[dict[str, Any], ExitCode]:
    """Plan (and with ``settle``, carry out) recovery for every row (or the named ids'); the report, the exit code."""
    settings = current_settings()
    configure_logging(settings.debug)
    from kafka2pc import IndefiniteOutcomeError, PreparedTxnState, TransactionOutcome, UsageError

    from ._statedb import RowLocks, masked_url, read_states

    rows: list[StoredState] = read_states(db_url, table, timeout_s=settings.timeout_s)
    entries: list[dict[str, Any]] = []
    if transactional_ids:
        wanted = set(transactional_ids)
        rows = [row for row in rows if row.transactional_id in wanted]
        found = {row.transactional_id for row in rows}
        entries.extend(
            {**dict.fromkeys(_ENTRY_FIELDS), "transactional_id": tid, "heuristic": False,
             "error": f"no row for this transactional id in {table}"}
            for tid in transactional_ids if tid not in found
        )
    settled_states: dict[str, PreparedTxnState] = {}
    indefinite = False
    locks = RowLocks(db_url, table, timeout_s=settings.timeout_s) if settle and not dry_run else None
    with open_admin() as admin, contextlib.ExitStack() as cleanup:
        if locks is not None:
            cleanup.callback(locks.close)
        for row in rows:
            entry: dict[str, Any] = {
                **dict.fromkeys(_ENTRY_FIELDS),
                "transactional_id": row.transactional_id,
                "stored_state": row.prepared_txn_state,
                "updated_at": row.updated_at,
                "heuristic": False,
            }
            entries.append(entry)
            try:
                state = PreparedTxnState(row.prepared_txn_state)
                if locks is not None:
                    # Settle under the row lock, with the state as it is now: a live
                    # writer holds the same lock from its state update to its commit.
                    with locks.hold(row.transactional_id) as held:
                        entry["stored_state"] = held.state
                        state = PreparedTxnState(held.state)
                        plan = admin.plan_recovery(row.transactional_id, state)
                        if plan.decision.value == "nothing":
                            # Nothing to settle: send nothing.  Settling anyway could abort a
                            # transaction a live writer began after this plan, with no claim
                            # committed to stop that writer's database commit.
                            entry["outcome"] = plan.stored_outcome.value
                            entry["heuristic"] = plan.heuristic
                        else:
                            held.claim()  # committed before Kafka is touched: a live writer cannot commit
                            settlement = admin.complete_transaction(
                                row.transactional_id, state, fence=True, on_heuristic="report"
                            )
                            if settlement.plan.decision.value != "nothing":
                                held.taken_over()  # fenced: a live writer must learn it before it commits
                            plan = settlement.plan
                            entry["outcome"] = settlement.outcome.value
                            entry["heuristic"] = settlement.heuristic
                else:
                    plan = admin.plan_recovery(row.transactional_id, state)
                    entry["heuristic"] = plan.heuristic
            except UsageError as exc:  # malformed stored state, or a state of another transactional id
                entry["error"] = " ".join(str(exc).split())
                info = admin.describe_transaction(row.transactional_id)
                _fill_kafka_fields(entry, None if info is None else info.description)
                continue
            except IndefiniteOutcomeError as exc:
                indefinite = True
                entry["error"] = " ".join(str(exc).split())
                continue
            _fill_kafka_fields(entry, plan.coordinator)
            entry.update(decision=plan.decision.value, stored_outcome=plan.stored_outcome.value, reason=plan.reason)
            settled_states[row.transactional_id] = state
        # A stored transaction's outcome is "unknown" while another open transaction holds
        # back its partition's LSO.  Once every row is settled, ask again: an abort found
        # only now is still a heuristic outcome that must not go unreported.
        unknown = {
            entry["transactional_id"]: settled_states[entry["transactional_id"]]
            for entry in entries
            if entry["outcome"] == "unknown" and entry["transactional_id"] in settled_states
        }
        if unknown:
            outcomes = admin.outcomes_of_settled(unknown)
            for entry in entries:
                again = outcomes.get(entry["transactional_id"])
                if again is not None and entry["outcome"] == "unknown":
                    entry["outcome"] = again.value
                    entry["heuristic"] = again is TransactionOutcome.ABORTED
    summary = {
        "rows": len(entries),
        "commit": sum(e["decision"] == "commit" for e in entries),
        "abort": sum(e["decision"] == "abort" for e in entries),
        "nothing": sum(e["decision"] == "nothing" for e in entries),
        "heuristic": sum(bool(e["heuristic"]) for e in entries),
        "errors": sum(e["error"] is not None for e in entries),
    }
    document = {
        "version": JSON_VERSION,
        "command": "recover" if settle else "in-doubt",
        "dry_run": dry_run,
        "database": masked_url(db_url),
        "table": table,
        "entries": entries,
        "summary": summary,
    }
    if summary["heuristic"]:
        code = ExitCode.HEURISTIC
    elif indefinite:
        code = ExitCode.INDEFINITE
    elif summary["errors"]:
        code = ExitCode.FAILURE
    else:
        code = ExitCode.OK
    return document, code


def _prepared_text(stored_state: str | None) -> str:
    """The stored prepared state, short: ``producer/epoch topic-partition@first offset`` (``-``: empty)."""
    from kafka2pc import PreparedTxnState, UsageError

    try:
        state = PreparedTxnState(stored_state or "")
    except UsageError:
        return "invalid"
    if state.is_empty:
        return "-"
    anchor = state.anchor
    where = f" {anchor[0].topic}-{anchor[0].partition}@{anchor[1]}" if anchor else ""
    return f"{state.producer_id}/{state.epoch}{where}"


def _report_text(document: dict[str, Any], *, settled: bool) -> str:
    headers = ["TRANSACTIONAL ID", "PREPARED (STORED)", "KAFKA STATE", "PRODUCER", "OPEN FOR", "DECISION"]
    headers += ["STORED TXN", "REASON"] if not settled else ["STORED TXN NOW", "REASON"]
    rows = []
    for entry in document["entries"]:
        producer = "-" if entry["producer_id"] is None else f"{entry['producer_id']}/{entry['producer_epoch']}"
        decision = entry["decision"] or "error"
        if entry["heuristic"]:
            decision += " + HEURISTIC"
        stored = entry["outcome"] if settled else entry["stored_outcome"]
        rows.append([
            entry["transactional_id"], _prepared_text(entry["stored_state"]), entry["kafka_state"] or "unknown id",
            producer, format_duration(entry["open_for_ms"]), decision, stored or "-", entry["error"] or entry["reason"],
        ])
    summary = document["summary"]
    prefix = "dry run: would " if document["dry_run"] else ("settled: " if settled else "recovery would ")
    tail = (
        f"{prefix}commit {summary['commit']}, abort {summary['abort']}, leave {summary['nothing']}; "
        f"{summary['heuristic']} heuristic, {summary['errors']} errors ({summary['rows']} rows in "
        f"{document['table']})"
    )
    if not rows:
        return f"no rows in {document['table']}"
    text = render_table(headers, rows) + "\n" + tail
    if summary["heuristic"]:
        text += (
            "\nHEURISTIC OUTCOME: Kafka aborted transactions the database committed; their records are "
            "not visible to read_committed consumers (re-publish them or reconcile the database)"
        )
    return text


@cli.command("in-doubt")
@_db_options
@watch_options
@output_option
@connection_options(group=False)
def in_doubt_command(
    db_url: str, table: str, transactional_ids: tuple[str, ...], watch_s: float | None, count: int | None, output: str
) -> None:
    """What is prepared, for how long, and what recovery would decide, per stored state of the dual write.

    Joins the state table with the coordinator's view: per transactional id
    the stored prepared transaction (producer/epoch and its first record),
    its Kafka state, how long the open transaction has been open, and the
    decision (commit, abort, nothing; HEURISTIC when Kafka aborted a
    transaction the database committed).  Changes nothing.  Exit code 3 if a
    heuristic outcome is found (in the last refresh, with --watch).
    """
    codes = []

    def show() -> None:
        document, code = _report(
            settle=False, dry_run=False, db_url=db_url, table=table, transactional_ids=transactional_ids
        )
        codes.append(code)
        if output == "json":
            click.echo(dump_json(document) if watch_s is None else dump_json_line(document))
        else:
            click.echo(_report_text(document, settled=False))

    watch(watch_s, count, show)
    code = codes[-1] if codes else ExitCode.OK
    if code is not ExitCode.OK:
        click.get_current_context().exit(int(code))


@cli.command("recover")
@_db_options
@click.option("--dry-run", is_flag=True, help="Only say what would be done (same as in-doubt).")
@output_option
@connection_options(group=False)
def recover_command(
    db_url: str, table: str, transactional_ids: tuple[str, ...], dry_run: bool, output: str
) -> None:
    """Settle every prepared transaction stored by the dual-write recipe.

    Per row: commit the open transaction if it is the stored prepared one,
    else abort it; then fence the producer.  Run it while the application's
    producers are stopped.  Each row is locked while it is settled (a no-op
    UPDATE); a row whose producer was fenced is committed unchanged, which
    gives it a new version so that a writer still running learns it was taken
    over; no stored value changes.  Exit code 3 if a heuristic outcome is
    found, 9 if an outcome is not known yet (run again).
    """
    document, code = _report(
        settle=True, dry_run=dry_run, db_url=db_url, table=table, transactional_ids=transactional_ids
    )
    click.echo(dump_json(document) if output == "json" else _report_text(document, settled=not dry_run))
    if code is not ExitCode.OK:
        click.get_current_context().exit(int(code))
