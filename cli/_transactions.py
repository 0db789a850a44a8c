"""``list``, ``describe``, ``complete`` and ``force-terminate``: one transaction at a time, by transactional id."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click

from ._errors import CliFailure, ExitCode
from ._group import cli
from ._options import (
    COORDINATOR_STATES,
    DURATION,
    connection_options,
    one_transactional_id,
    open_admin,
    output_option,
    transactional_id_option,
    unknown_id,
)
from ._render import (
    JSON_VERSION,
    TRANSACTION_HEADERS,
    dump_json,
    format_duration,
    render_table,
    transaction_json,
    transaction_rows,
)

if TYPE_CHECKING:
    from kafka2pc import TransactionInfo

__all__ = ["describe_text"]


@cli.command("list")
@click.option(
    "--min-open", type=DURATION, default=None, metavar="DURATION",
    help="Only transactions open at least this long (90, 90s, 15m, 2h; 0 = every open one).",
)
@click.option(
    "--state", "states", multiple=True, metavar="STATE",
    type=click.Choice(COORDINATOR_STATES, case_sensitive=False),
    help=f"Only transactions in this coordinator state (repeatable): {', '.join(COORDINATOR_STATES)}.",
)
@output_option
@connection_options(group=False)
def list_command(min_open: float | None, states: tuple[str, ...], output: str) -> None:
    """Transactions across the cluster, oldest first, with the records each holds back."""
    with open_admin() as admin:
        infos = admin.list_transactions(min_open_s=min_open, states=states)
    if output == "json":
        click.echo(dump_json({"version": JSON_VERSION, "transactions": [transaction_json(i) for i in infos]}))
        return
    if not infos:
        click.echo("no transactions" + (" open that long" if min_open is not None else ""))
        return
    click.echo(render_table(TRANSACTION_HEADERS, [row for info in infos for row in transaction_rows(info)]))


def describe_text(info: TransactionInfo) -> str:
    doc = transaction_json(info)
    started = "-"
    if doc["start_time_ms"] is not None:
        started = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(doc["start_time_ms"] / 1000))
        started += f".{doc['start_time_ms'] % 1000:03d}Z"
    lines = [
        f"Transactional id: {doc['transactional_id']}",
        f"State:            {doc['state']}",
        f"Producer id:      {doc['producer_id']}",
        f"Producer epoch:   {doc['producer_epoch']}",
        f"Coordinator:      {doc['coordinator_id']}",
        f"Timeout:          {format_duration(doc['timeout_ms'])} ({doc['timeout_ms']} ms)",
        f"Started:          {started}",
        f"Open for:         {format_duration(doc['open_for_ms'])}",
        f"Held back:        {doc['held_back']} records (high watermark - last stable offset, all partitions)",
    ]
    if doc["partitions"]:
        lines.append("")
        lines.append(render_table(
            ("PARTITION", "LSO", "HW", "HELD BACK"),
            [
                (f"{p['topic']}-{p['partition']}", p["last_stable_offset"], p["high_watermark"], p["held_back"])
                for p in doc["partitions"]
            ],
        ))
    return "\n".join(lines)




@cli.command("describe")
@click.argument("transactional_id", required=False)
@transactional_id_option
@output_option
@connection_options(group=False)
def describe_command(transactional_id: str | None, transactional_id_option: str | None, output: str) -> None:
    """One transaction: state, producer id/epoch, age, and per partition the LSO it pins."""
    transactional_id = one_transactional_id(transactional_id, transactional_id_option)
    with open_admin() as admin:
        info = admin.describe_transaction(transactional_id)
    if info is None:
        raise unknown_id(transactional_id)
    if output == "json":
        click.echo(dump_json({"version": JSON_VERSION, "transaction": transaction_json(info)}))
    else:
        click.echo(describe_text(info))


# -- complete / force-terminate ---------------------------------------------------------


@cli.command("complete", context_settings={"ignore_unknown_options": True})  # STATE may be "-1:-1"
@click.argument("transactional_id", required=False)
@click.argument("state", required=False)
@transactional_id_option
@click.option("--dry-run", is_flag=True, help="Only say what would be done.")
@connection_options(group=False)
def complete_command(
    transactional_id: str | None, state: str | None, transactional_id_option: str | None, dry_run: bool
) -> None:
    """Commit the open transaction iff STATE names it (the stored prepared state), else abort it.

    STATE is the text of a PreparedTxnState (k2pc1:..., or '-1:-1' for none).
    Afterwards the producer is fenced (its epoch bumped).  Exit code 3 if Kafka
    had already aborted the transaction STATE names (a heuristic outcome).
    With --transactional-id ID, STATE is the only argument.
    """
    from kafka2pc import PreparedTxnState

    if transactional_id_option is not None and state is None:
        transactional_id, state = None, transactional_id
    transactional_id = one_transactional_id(transactional_id, transactional_id_option)
    if state is None:
        raise click.UsageError("missing STATE (the stored prepared state; '-1:-1' for none)")

    prepared = PreparedTxnState(state)
    prepared.check_transactional_id(transactional_id)
    with open_admin() as admin:
        if dry_run:
            plan = admin.plan_recovery(transactional_id, prepared)
            outcome, heuristic = None, plan.heuristic
        else:
            settlement = admin.complete_transaction(
                transactional_id, prepared, fence=True, on_heuristic="report"
            )
            plan, outcome, heuristic = settlement.plan, settlement.outcome, settlement.heuristic
    if plan.coordinator is None:
        raise unknown_id(transactional_id)
    coordinator = plan.coordinator
    ids = f"producer id {coordinator.producer_id}, epoch {coordinator.producer_epoch}"
    verb = {"commit": "commit", "abort": "abort", "nothing": "nothing to do"}[plan.decision.value]
    click.echo(f"decision: {verb} ({plan.reason})")
    if dry_run:
        click.echo(f"dry run: nothing changed; the {coordinator.state} transaction ({ids}) is as it was")
    elif plan.decision.value == "commit":
        click.echo(f"outcome: committed the prepared transaction ({ids}); producer fenced")
    elif plan.decision.value == "abort":
        stored = outcome.value if outcome is not None else "unknown"
        click.echo(
            f"outcome: aborted the open transaction ({ids}); the stored transaction is {stored}; producer fenced"
        )
    else:
        stored = outcome.value if outcome is not None else plan.stored_outcome.value
        click.echo(f"outcome: no transaction was open; the stored transaction is {stored}; producer fenced")
    if heuristic:
        click.echo(
            f"HEURISTIC OUTCOME: Kafka aborted the prepared transaction {prepared} that the database "
            "committed; its records are not visible to read_committed consumers", err=True,
        )
        click.get_current_context().exit(int(ExitCode.HEURISTIC))


@cli.command("force-terminate")
@click.argument("transactional_id", required=False)
@transactional_id_option
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@connection_options(group=False)
def force_terminate_command(transactional_id: str | None, transactional_id_option: str | None, yes: bool) -> None:
    """Abort whatever transaction TRANSACTIONAL_ID has open and fence its producer (KIP-939).

    Its records never become visible; the producer that opened it (or a
    recovering one) gets ProducerFenced.  If a database committed that
    transaction's prepared state, this makes the outcome heuristic: prefer
    'kafka2pc complete' or 'kafka2pc recover'.
    """
    transactional_id = one_transactional_id(transactional_id, transactional_id_option)
    with open_admin() as admin:
        info = admin.describe_transaction(transactional_id)
        if info is None:
            raise unknown_id(transactional_id)
        if not yes:
            click.echo(describe_text(info))
            question = (
                f"Abort the {info.state} transaction of {transactional_id!r} and fence producer "
                f"{info.description.producer_id} (epoch {info.description.producer_epoch})?"
                if info.is_open
                else f"No transaction is open; fence producer {info.description.producer_id} "
                f"(epoch {info.description.producer_epoch}) of {transactional_id!r}?"
            )
            try:
                confirmed = click.confirm(question, default=False)
            except click.Abort:
                click.echo()
                confirmed = False
            if not confirmed:
                raise CliFailure(
                    "nothing was terminated (not confirmed; pass --yes to skip the question)", ExitCode.FAILURE
                )
        before = admin.force_terminate_transaction(transactional_id)
        if before is None:
            raise unknown_id(transactional_id)
        after = admin.describe_transaction(transactional_id)
    new_epoch = "?" if after is None else str(after.description.producer_epoch)
    partitions = ", ".join(f"{tp.topic}-{tp.partition}" for tp in before.partitions) or "no partitions"
    if before.state in ("Ongoing", "PrepareCommit", "PrepareAbort", "PrepareEpochFence"):
        click.echo(
            f"terminated {transactional_id!r}: aborted its {before.state} transaction (producer id "
            f"{before.producer_id}, epoch {before.producer_epoch}) on {partitions}; "
            f"producer fenced: epoch {before.producer_epoch} -> {new_epoch}"
        )
    else:
        click.echo(
            f"terminated {transactional_id!r}: no transaction was open (state {before.state}); producer id "
            f"{before.producer_id} fenced: epoch {before.producer_epoch} -> {new_epoch}"
        )
