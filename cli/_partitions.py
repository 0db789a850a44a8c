"""``describe-producers``, ``find-hanging`` and ``abort``: partitions, as ``kafka-transactions.sh`` sees them."""

from __future__ import annotations

import time

import click

from ._errors import CliFailure, ExitCode
from ._group import cli
from ._options import (
    DEFAULT_STATE_TABLE,
    DURATION,
    connection_options,
    current_settings,
    open_admin,
    output_option,
)
from ._render import (
    JSON_VERSION,
    dump_json,
    format_duration,
    open_transaction_json,
    producer_json,
    render_table,
)

__all__: list[str] = []




def _timestamp(ms: int) -> str:
    if ms < 0:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


@cli.command("describe-producers")
@click.option("--topic", required=True, metavar="TOPIC", help="The topic.")
@click.option("--partition", required=True, type=click.IntRange(min=0), metavar="N", help="The partition.")
@output_option
@connection_options(group=False)
def describe_producers_command(topic: str, partition: int, output: str) -> None:
    """The active producers of one partition (its leader's view), with the transaction each has open there.

    START OFFSET is the offset of the first record of the producer's open
    transaction on the partition ('-' when none is open): the partition's last
    stable offset cannot pass it until that transaction ends.
    """
    from kafka2pc import TopicAndPartition as TopicPartition

    with open_admin() as admin:
        producers = admin.describe_producers(TopicPartition(topic, partition))
    rows = [producer_json(p) for p in sorted(producers, key=lambda p: p.producer_id)]
    if output == "json":
        click.echo(dump_json({"version": JSON_VERSION, "topic": topic, "partition": partition, "producers": rows}))
        return
    if not rows:
        click.echo(f"no active producers on {topic}-{partition}")
        return
    click.echo(render_table(
        ("PRODUCER ID", "EPOCH", "COORDINATOR EPOCH", "LAST SEQUENCE", "LAST TIMESTAMP", "START OFFSET"),
        [
            (r["producer_id"], r["producer_epoch"], r["coordinator_epoch"], r["last_sequence"],
             _timestamp(r["last_timestamp_ms"]),
             "-" if r["current_transaction_start_offset"] is None else r["current_transaction_start_offset"])
            for r in rows
        ],
    ))


@cli.command("find-hanging")
@click.option("--topic", metavar="TOPIC", help="Look at this topic's partitions.")
@click.option("--partition", type=click.IntRange(min=0), metavar="N", help="Only this partition of --topic.")
@click.option("--broker-id", type=int, metavar="ID", help="Look at every partition this broker leads.")
@click.option(
    "--max-transaction-timeout", "max_timeout_s", type=DURATION, default=None, metavar="DURATION",
    help="The cluster's transaction.max.timeout.ms (as a duration: 15m): an open transaction whose producer "
    "wrote last longer ago than this is a candidate [default: 15m].",
)
@click.option("--all-open", is_flag=True, help="Also list candidates their coordinator still tracks (not hanging).")
@click.option(
    "--older-than", "older_than_s", type=DURATION, default=None, metavar="DURATION",
    help="Deprecated: 'kafka2pc stuck --older-than DURATION' (the same options follow it).",
)
@click.option("--abort", "abort", is_flag=True, help="Deprecated, with --older-than: see 'kafka2pc stuck'.")
@click.option("--yes", "-y", is_flag=True, help="Deprecated, with --older-than: see 'kafka2pc stuck'.")
@click.option("--db-url", metavar="URL", help="Deprecated, with --older-than: see 'kafka2pc stuck'.")
@click.option("--table", default=DEFAULT_STATE_TABLE, show_default=True, metavar="NAME",
              help="Deprecated, with --older-than: see 'kafka2pc stuck'.")
@click.option("--lease-table", metavar="NAME", help="Deprecated, with --older-than: see 'kafka2pc stuck'.")
@click.option("--no-db", is_flag=True, help="Deprecated, with --older-than: see 'kafka2pc stuck'.")
@output_option
@connection_options(group=False)
def find_hanging_command(
    topic: str | None, partition: int | None, broker_id: int | None, max_timeout_s: float | None, all_open: bool,
    older_than_s: float | None, abort: bool, yes: bool, db_url: str | None, table: str, lease_table: str | None,
    no_db: bool, output: str,
) -> None:
    """Transactions a partition holds open although no coordinator does: they pin its last stable offset.

    Per partition (of --topic, or led by --broker-id): producers with an open
    transaction that last wrote longer ago than --max-transaction-timeout; one
    is HANGING unless a coordinator has that producer id's transaction open
    with this partition in it.  End a hanging one with 'kafka2pc abort'.
    A prepared two-phase-commit transaction whose owner died is not hanging
    (its coordinator tracks it): settle it with 'complete' or 'recover', or
    apply the policy for stuck transactions with 'kafka2pc stuck'.

    --older-than (and --abort, --yes, --db-url, --table, --lease-table,
    --no-db) is the deprecated spelling of 'kafka2pc stuck'.
    """
    if older_than_s is not None:
        if topic is not None or broker_id is not None or partition is not None:
            raise click.UsageError("--older-than looks at the whole cluster: no --topic, --partition or --broker-id")
        from ._stuck import run_stuck

        click.echo("warning: 'find-hanging --older-than' is deprecated; use 'kafka2pc stuck --older-than' "
                   "(same options)", err=True)
        run_stuck(older_than_s, abort=abort, yes=yes, db_url=db_url, table=table, lease_table=lease_table,
                  no_db=no_db, output=output, command="find-hanging")
        return
    from kafka2pc import TransactionAdmin

    if abort or db_url is not None or lease_table is not None:
        raise click.UsageError("--abort, --db-url and --lease-table go with --older-than")
    if (topic is None) == (broker_id is None):
        raise click.UsageError("give --topic TOPIC [--partition N] or --broker-id ID")
    if partition is not None and topic is None:
        raise click.UsageError("--partition needs --topic")
    limit = (TransactionAdmin.DEFAULT_MAX_TRANSACTION_TIMEOUT_MS if max_timeout_s is None
             else round(max_timeout_s * 1000))
    with open_admin() as admin:
        tps = admin.partitions(
            topic=topic, partition=partition, broker_id=broker_id, timeout=current_settings().timeout_s
        )
        found = admin.find_hanging_transactions(tps, max_transaction_timeout_s=limit / 1000)
    shown = [o for o in found if all_open or o.hanging]
    if output == "json":
        click.echo(dump_json({
            "version": JSON_VERSION, "partitions": len(tps), "max_transaction_timeout_ms": limit,
            "transactions": [open_transaction_json(o) for o in shown],
        }))
        return
    if not shown:
        click.echo(f"no hanging transactions on {len(tps)} partitions"
                   + ("" if all_open else f" ({len(found)} open ones tracked by their coordinator)" if found else ""))
        return
    click.echo(render_table(
        ("PARTITION", "PRODUCER ID", "EPOCH", "COORDINATOR EPOCH", "START OFFSET", "LAST WRITE", "TRANSACTIONAL ID",
         "HANGING", "REASON"),
        [
            (f"{o.partition.topic}-{o.partition.partition}", o.producer.producer_id, o.producer.producer_epoch,
             o.producer.coordinator_epoch, o.producer.current_txn_start_offset,
             format_duration(round(o.duration_s * 1000)) + " ago", o.transactional_id or "-",
             "yes" if o.hanging else "no", o.reason)
            for o in shown
        ],
    ))


@cli.command("abort")
@click.option("--topic", required=True, metavar="TOPIC", help="The partition's topic.")
@click.option("--partition", required=True, type=click.IntRange(min=0), metavar="N", help="The partition.")
@click.option("--start-offset", type=click.IntRange(min=0), metavar="OFFSET",
              help="Find the producer by its open transaction's first offset (see describe-producers).")
@click.option(
    "--producer-id", type=click.IntRange(min=0), metavar="ID", help="The producer id (with --producer-epoch)."
)
@click.option("--producer-epoch", type=click.IntRange(min=0), metavar="EPOCH", help="The producer epoch.")
@click.option("--coordinator-epoch", type=int, default=-1, show_default=True, metavar="EPOCH",
              help="-1 skips the partition leader's coordinator-epoch check, as kafka-transactions.sh does.")
@click.option("--force", is_flag=True,
              help="Abort even if a coordinator still tracks the transaction (it is then not hanging).")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@connection_options(group=False)
def abort_command(
    topic: str, partition: int, start_offset: int | None, producer_id: int | None, producer_epoch: int | None,
    coordinator_epoch: int, force: bool, yes: bool,
) -> None:
    """Abort a hanging transaction on one partition: write its abort marker (WriteTxnMarkers).

    Name the transaction by --start-offset, or by --producer-id and
    --producer-epoch.  Its records on this partition become aborted and the
    partition's last stable offset moves on.  Refused, unless --force, while
    a coordinator still tracks the transaction: a prepared two-phase-commit
    transaction must be settled by 'complete' or 'recover', which know
    whether the database committed it.
    """
    from kafka2pc import TopicAndPartition as TopicPartition

    if (start_offset is None) == (producer_id is None and producer_epoch is None):
        raise click.UsageError("name the transaction by --start-offset, or by --producer-id and --producer-epoch")
    if start_offset is None and (producer_id is None or producer_epoch is None):
        raise click.UsageError("--producer-id and --producer-epoch go together")
    tp = TopicPartition(topic, partition)
    with open_admin() as admin:
        open_here = [p for p in admin.describe_producers(tp) if p.current_txn_start_offset >= 0]
        matches = [
            p for p in open_here
            if (start_offset is not None and p.current_txn_start_offset == start_offset)
            or (start_offset is None and p.producer_id == producer_id and p.producer_epoch == producer_epoch)
        ]
        if not matches:
            wanted = (f"starting at offset {start_offset}" if start_offset is not None
                      else f"of producer {producer_id} epoch {producer_epoch}")
            raise CliFailure(f"{topic}-{partition} has no open transaction {wanted} (see describe-producers)",
                             ExitCode.NOT_FOUND)
        target = matches[0]
        judged = next(
            (o for o in admin.find_hanging_transactions([tp], max_transaction_timeout_s=0)
             if o.producer.producer_id == target.producer_id),
            None,
        )
        if judged is not None and not judged.hanging and not force:
            raise CliFailure(
                f"the transaction of producer {target.producer_id} on {topic}-{partition} is not hanging: "
                f"{judged.transactional_id!r} has it {judged.reason}. Settle it with 'kafka2pc complete' or "
                "'kafka2pc recover' (or 'force-terminate'); --force aborts it on this partition anyway",
                ExitCode.FAILURE,
            )
        what = (f"the open transaction of producer {target.producer_id} (epoch {target.producer_epoch}) on "
                f"{topic}-{partition}, first offset {target.current_txn_start_offset}")
        if not yes:
            try:
                confirmed = click.confirm(f"Abort {what}?", default=False)
            except click.Abort:
                click.echo()
                confirmed = False
            if not confirmed:
                raise CliFailure("nothing was aborted (not confirmed; pass --yes to skip the question)",
                                 ExitCode.FAILURE)
        lag = admin.abort_partition_transaction(
            tp, target.producer_id, target.producer_epoch, coordinator_epoch=coordinator_epoch
        )
    click.echo(f"aborted {what}; last stable offset now {lag.last_stable_offset} (high watermark {lag.high_watermark})")
