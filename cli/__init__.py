"""``kafka2pc``: the operator's command line for in-doubt Kafka transactions.

A thin client of :class:`kafka2pc.TransactionAdmin`: it lists and describes
transactions (with what each costs ``read_committed`` consumers), settles one
from its prepared state, force-terminates one, and joins the prepared states
the dual-write recipe stored in a database with the coordinator's view
(``in-doubt``) and settles them (``recover``).  See ``docs/cli.md``.

Start-up is kept cheap on purpose (``kafka2pc --help`` runs in well under a
second): this module imports only click and pure-Python parts of kafka2pc;
kafka-python, confluent-kafka and SQLAlchemy are imported by the commands
that need them, when they run.

Every failure ends as one line on stderr and a documented exit code
(:class:`kafka2pc.cli._errors.ExitCode`); exceptions are mapped in one place,
:meth:`_Kafka2pcGroup.invoke`.  ``--debug`` shows tracebacks and library logs.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kafka2pc._extras import missing_extra

try:
    import click
except ImportError as exc:
    raise missing_extra(exc, extra="cli", feature="the kafka2pc command line") from exc

from kafka2pc import __version__

from ._errors import CliFailure, ExitCode, classify, error_json
from ._render import (
    JSON_VERSION,
    TRANSACTION_HEADERS,
    dump_json,
    format_duration,
    open_for_ms,
    open_transaction_json,
    parse_duration_ms,
    producer_json,
    render_table,
    transaction_json,
    transaction_rows,
)

if TYPE_CHECKING:
    from kafka2pc import TransactionAdmin, TransactionDescription, TransactionInfo

    from ._statedb import StoredState

__all__ = ["ExitCode", "cli", "main"]

_F = TypeVar("_F", bound=Callable[..., Any])

DEFAULT_TIMEOUT_S = 15.0
COORDINATOR_STATES = (
    "Empty", "Ongoing", "PrepareCommit", "PrepareAbort", "CompleteCommit", "CompleteAbort", "Dead",
    "PrepareEpochFence",
)
_META = "kafka2pc.cli."


# -- options shared by the group and every command -----------------------------------


def _remember(name: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """Store an option's value in ``ctx.meta`` (shared by the group and its commands).

    The connection options are accepted both before and after the command name
    (``kafka2pc --bootstrap-server X list`` and ``kafka2pc list --bootstrap-server X``);
    the command's value, parsed last, wins.
    """

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None and value is not False:
            ctx.meta[_META + name] = value
        return value

    return callback


def _connection_options(*, group: bool) -> Callable[[_F], _F]:
    def decorate(func: _F) -> _F:
        options = [
            click.option(
                "--bootstrap-server", metavar="HOST:PORT[,HOST:PORT]", expose_value=False,
                envvar="KAFKA_BOOTSTRAP_SERVERS" if group else None, show_envvar=group,
                callback=_remember("bootstrap_server"),
                help="Kafka brokers to connect to.",
            ),
            click.option(
                "--command-config", metavar="FILE", expose_value=False, callback=_remember("command_config"),
                help="Kafka client properties file (key=value; security.protocol, sasl.*, ssl.*), "
                "as for Apache Kafka's own tools.",
            ),
            click.option(
                "--timeout", metavar="SECONDS", type=click.FloatRange(min=0.1), expose_value=False,
                callback=_remember("timeout"),
                help=f"Give up on an unreachable cluster after this long [default: {DEFAULT_TIMEOUT_S:g}].",
            ),
            click.option(
                "--debug", is_flag=True, default=False, expose_value=False, callback=_remember("debug"),
                help="Show tracebacks and library logs.",
            ),
        ]
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


def _output_option(func: _F) -> _F:
    return click.option(
        "--output", "-o", type=click.Choice(["table", "json"]), default="table", show_default=True,
        help="Human-readable table, or JSON (shape: https://kafka2pc.github.io/kafka2pc/cli/).",
    )(func)


def _duration_ms(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_duration_ms(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


@dataclass(frozen=True)
class _Settings:
    bootstrap_server: str | None
    command_config: str | None
    timeout_s: float
    debug: bool


def _settings() -> _Settings:
    meta = click.get_current_context().meta
    return _Settings(
        bootstrap_server=meta.get(_META + "bootstrap_server"),
        command_config=meta.get(_META + "command_config"),
        timeout_s=float(meta.get(_META + "timeout", DEFAULT_TIMEOUT_S)),
        debug=bool(meta.get(_META + "debug", False)),
    )


def _configure_logging(debug: bool) -> None:
    root = logging.getLogger()
    if debug:
        logging.basicConfig(
            level=logging.DEBUG, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s"
        )
        # kafka-python's DEBUG output is megabytes of wire dumps, credentials included.
        logging.getLogger("kafka").setLevel(logging.INFO)
    elif not root.handlers:
        # The CLI reports outcomes itself; keep library warnings (e.g. kafka-python's
        # connection retries) out of the one-line error output.
        root.addHandler(logging.NullHandler())


@contextlib.contextmanager
def _admin() -> Iterator[TransactionAdmin]:
    """A :class:`TransactionAdmin` for the connection options in effect (imported here: heavy)."""
    settings = _settings()
    _configure_logging(settings.debug)
    from kafka2pc import BrokerUnavailableError, TransactionAdmin, UsageError

    from ._config import client_config, read_properties

    try:
        properties = read_properties(settings.command_config) if settings.command_config else {}
        config = client_config(settings.bootstrap_server, properties)
        admin = TransactionAdmin(config, request_timeout_s=settings.timeout_s)
    except UsageError as exc:
        if not settings.command_config or str(exc).startswith("--command-config"):
            raise
        raise type(exc)(f"--command-config {settings.command_config}: {exc}") from exc
    try:
        yield admin
    except BrokerUnavailableError as exc:
        from ._probe import diagnose_unreachable

        precise = diagnose_unreachable(config, settings.timeout_s)
        if precise is not None:
            raise precise from exc
        raise
    finally:
        admin.close()


def _unknown_id(transactional_id: str) -> CliFailure:
    return CliFailure(
        f"unknown transactional id {transactional_id!r}: the cluster's transaction coordinator has no "
        "record of it (never used, or expired after transactional.id.expiration.ms)",
        ExitCode.NOT_FOUND,
    )


# -- the group: one place that maps exceptions to exit codes --------------------------


class _ExitWithMessage(click.ClickException):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares a per-class code; ours vary


def _wants_json(args: list[str]) -> bool:
    """True when the command line asks for ``--output json`` / ``-o json`` (any spelling click accepts)."""
    for i, arg in enumerate(args):
        if arg == "--":
            return False
        if arg in ("-o", "--output") and i + 1 < len(args) and args[i + 1] == "json":
            return True
        if arg in ("-ojson", "--output=json"):
            return True
    return False


class _Kafka2pcGroup(click.Group):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[_META + "json"] = _wants_json(list(args))
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            try:
                return super().invoke(ctx)
            except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
                raise
            except Exception as exc:
                if ctx.meta.get(_META + "debug"):
                    raise
                code, message = classify(exc)
                raise _ExitWithMessage(message, int(code)) from exc
        except click.exceptions.ClickException as exc:
            if ctx.meta.get(_META + "json"):
                # Scripts read stdout: the error is a JSON document there too (schema "error").
                click.echo(dump_json(error_json(exc.exit_code, exc.format_message())))
            raise


@click.group(cls=_Kafka2pcGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kafka2pc")
@_connection_options(group=True)
def cli() -> None:
    """Inspect and settle Kafka transactions, including in-doubt two-phase-commit ones.

    Exit codes: 0 ok, 1 failure, 2 usage, 3 heuristic outcome found, 4 unknown
    transactional id, 5 Kafka unreachable, 6 authorization failure, 7 database
    error, 8 unsupported by the broker, 9 outcome not known yet (see https://kafka2pc.github.io/kafka2pc/cli/).
    With -o json an error is also a JSON document on stdout: {"version": 1,
    "error": {"exit_code": N, "name": "...", "message": "..."}}.
    """


# -- list / describe ----------------------------------------------------------------


@cli.command("list")
@click.option(
    "--min-open", callback=_duration_ms, default=None, metavar="DURATION",
    help="Only transactions open at least this long (90s, 15m, 1h; 0s = every open one).",
)
@click.option(
    "--state", "states", multiple=True, metavar="STATE",
    type=click.Choice(COORDINATOR_STATES, case_sensitive=False),
    help=f"Only transactions in this coordinator state (repeatable): {', '.join(COORDINATOR_STATES)}.",
)
@_output_option
@_connection_options(group=False)
def list_command(min_open: int | None, states: tuple[str, ...], output: str) -> None:
    """Transactions across the cluster, oldest first, with the records each holds back."""
    with _admin() as admin:
        infos = admin.list_transactions(min_open_s=None if min_open is None else min_open / 1000, states=states)
    if output == "json":
        click.echo(dump_json({"version": JSON_VERSION, "transactions": [transaction_json(i) for i in infos]}))
        return
    if not infos:
        click.echo("no transactions" + (" open that long" if min_open is not None else ""))
        return
    click.echo(render_table(TRANSACTION_HEADERS, [row for info in infos for row in transaction_rows(info)]))


def _describe_text(info: TransactionInfo) -> str:
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


def _transactional_id_option(func: _F) -> _F:
    return click.option(
        "--transactional-id", "transactional_id_option", metavar="ID",
        help="The transactional id, as kafka-transactions.sh takes it (instead of the TRANSACTIONAL_ID argument).",
    )(func)


def _one_transactional_id(positional: str | None, option: str | None) -> str:
    """The id given as the TRANSACTIONAL_ID argument or as ``--transactional-id`` (not two different ones)."""
    if positional is not None and option is not None and positional != option:
        raise click.UsageError(f"two transactional ids: {positional!r} and --transactional-id {option!r}")
    chosen = option if option is not None else positional
    if chosen is None:
        raise click.UsageError("missing the transactional id (TRANSACTIONAL_ID or --transactional-id ID)")
    return chosen


@cli.command("describe")
@click.argument("transactional_id", required=False)
@_transactional_id_option
@_output_option
@_connection_options(group=False)
def describe_command(transactional_id: str | None, transactional_id_option: str | None, output: str) -> None:
    """One transaction: state, producer id/epoch, age, and per partition the LSO it pins."""
    transactional_id = _one_transactional_id(transactional_id, transactional_id_option)
    with _admin() as admin:
        info = admin.describe_transaction(transactional_id)
    if info is None:
        raise _unknown_id(transactional_id)
    if output == "json":
        click.echo(dump_json({"version": JSON_VERSION, "transaction": transaction_json(info)}))
    else:
        click.echo(_describe_text(info))


# -- complete / force-terminate ---------------------------------------------------------


@cli.command("complete", context_settings={"ignore_unknown_options": True})  # STATE may be "-1:-1"
@click.argument("transactional_id", required=False)
@click.argument("state", required=False)
@_transactional_id_option
@click.option("--dry-run", is_flag=True, help="Only say what would be done.")
@_connection_options(group=False)
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
    transactional_id = _one_transactional_id(transactional_id, transactional_id_option)
    if state is None:
        raise click.UsageError("missing STATE (the stored prepared state; '-1:-1' for none)")

    prepared = PreparedTxnState(state)
    prepared.check_transactional_id(transactional_id)
    with _admin() as admin:
        if dry_run:
            plan = admin.plan_recovery(transactional_id, prepared)
            outcome, heuristic = None, plan.heuristic
        else:
            settlement = admin.complete_transaction(
                transactional_id, prepared, fence=True, raise_on_heuristic=False
            )
            plan, outcome, heuristic = settlement.plan, settlement.outcome, settlement.heuristic
    if plan.coordinator is None:
        raise _unknown_id(transactional_id)
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
@_transactional_id_option
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@_connection_options(group=False)
def force_terminate_command(transactional_id: str | None, transactional_id_option: str | None, yes: bool) -> None:
    """Abort whatever transaction TRANSACTIONAL_ID has open and fence its producer (KIP-939).

    Its records never become visible; the producer that opened it (or a
    recovering one) gets ProducerFenced.  If a database committed that
    transaction's prepared state, this makes the outcome heuristic: prefer
    'kafka2pc complete' or 'kafka2pc recover'.
    """
    transactional_id = _one_transactional_id(transactional_id, transactional_id_option)
    with _admin() as admin:
        info = admin.describe_transaction(transactional_id)
        if info is None:
            raise _unknown_id(transactional_id)
        if not yes:
            click.echo(_describe_text(info))
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
            raise _unknown_id(transactional_id)
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


# -- partitions: describe-producers / find-hanging / abort (as kafka-transactions.sh) ----------------


def _duration_or_ms(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A duration (15m, 90s) or, as kafka-transactions.sh takes it, a number of milliseconds."""
    if value is None:
        return None
    if value.strip().isdigit():
        return int(value)
    return _duration_ms(ctx, param, value)


def _timestamp(ms: int) -> str:
    if ms < 0:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


@cli.command("describe-producers")
@click.option("--topic", required=True, metavar="TOPIC", help="The topic.")
@click.option("--partition", required=True, type=click.IntRange(min=0), metavar="N", help="The partition.")
@_output_option
@_connection_options(group=False)
def describe_producers_command(topic: str, partition: int, output: str) -> None:
    """The active producers of one partition (its leader's view), with the transaction each has open there.

    START OFFSET is the offset of the first record of the producer's open
    transaction on the partition ('-' when none is open): the partition's last
    stable offset cannot pass it until that transaction ends.
    """
    from kafka2pc import TopicAndPartition as TopicPartition

    with _admin() as admin:
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
    "--max-transaction-timeout", "max_timeout_ms", callback=_duration_or_ms, default=None, metavar="DURATION",
    help="The cluster's transaction.max.timeout.ms (15m, or milliseconds): an open transaction whose producer "
    "wrote last longer ago than this is a candidate [default: 15m].",
)
@click.option("--all-open", is_flag=True, help="Also list candidates their coordinator still tracks (not hanging).")
@_output_option
@_connection_options(group=False)
def find_hanging_command(
    topic: str | None, partition: int | None, broker_id: int | None, max_timeout_ms: int | None, all_open: bool,
    output: str,
) -> None:
    """Transactions a partition holds open although no coordinator does: they pin its last stable offset.

    Per partition (of --topic, or led by --broker-id): producers with an open
    transaction that last wrote longer ago than --max-transaction-timeout; one
    is HANGING unless a coordinator has that producer id's transaction open
    with this partition in it.  End a hanging one with 'kafka2pc abort'.
    A prepared two-phase-commit transaction whose owner died is not hanging
    (its coordinator tracks it): settle it with 'complete' or 'recover'.
    """
    from kafka2pc import TransactionAdmin

    if (topic is None) == (broker_id is None):
        raise click.UsageError("give --topic TOPIC [--partition N] or --broker-id ID")
    if partition is not None and topic is None:
        raise click.UsageError("--partition needs --topic")
    limit = TransactionAdmin.DEFAULT_MAX_TRANSACTION_TIMEOUT_MS if max_timeout_ms is None else max_timeout_ms
    with _admin() as admin:
        tps = admin.partitions(topic=topic, partition=partition, broker_id=broker_id, timeout=_settings().timeout_s)
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
             format_duration(o.duration_ms) + " ago", o.transactional_id or "-", "yes" if o.hanging else "no",
             o.reason)
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
@_connection_options(group=False)
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
    with _admin() as admin:
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


# -- in-doubt / recover -------------------------------------------------------------------


def _db_options(func: _F) -> _F:
    func = click.option(
        "--transactional-id", "transactional_ids", multiple=True, metavar="ID",
        help="Only this transactional id's row (repeatable); a named id without a row is an error.",
    )(func)
    func = click.option(
        "--table", default="kafka_transaction_state", show_default=True, metavar="NAME",
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
    settings = _settings()
    _configure_logging(settings.debug)
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
    with _admin() as admin, contextlib.ExitStack() as cleanup:
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
                                row.transactional_id, state, fence=True, raise_on_heuristic=False
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
@_output_option
@_connection_options(group=False)
def in_doubt_command(db_url: str, table: str, transactional_ids: tuple[str, ...], output: str) -> None:
    """What is prepared, for how long, and what recovery would decide, per stored state of the dual write.

    Joins the state table with the coordinator's view: per transactional id
    the stored prepared transaction (producer/epoch and its first record),
    its Kafka state, how long the open transaction has been open, and the
    decision (commit, abort, nothing; HEURISTIC when Kafka aborted a
    transaction the database committed).  Changes nothing.  Exit code 3 if a
    heuristic outcome is found.
    """
    document, code = _report(
        settle=False, dry_run=False, db_url=db_url, table=table, transactional_ids=transactional_ids
    )
    click.echo(dump_json(document) if output == "json" else _report_text(document, settled=False))
    if code is not ExitCode.OK:
        click.get_current_context().exit(int(code))


@cli.command("recover")
@_db_options
@click.option("--dry-run", is_flag=True, help="Only say what would be done (same as in-doubt).")
@_output_option
@_connection_options(group=False)
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


def main() -> None:
    """Console-script entry point (``kafka2pc``)."""
    cli(prog_name="kafka2pc")
