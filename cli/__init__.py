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

import click

from kafka2pc import __version__

from ._errors import CliFailure, ExitCode, classify
from ._render import (
    JSON_VERSION,
    TRANSACTION_HEADERS,
    dump_json,
    format_duration,
    open_for_ms,
    parse_duration_ms,
    render_table,
    transaction_json,
    transaction_rows,
)

if TYPE_CHECKING:
    from kafka2pc._admin import TransactionAdmin, TransactionInfo
    from kafka2pc._types import TransactionDescription

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
        help="Human-readable table, or JSON (shape in docs/cli.md).",
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
    from kafka2pc._admin import TransactionAdmin
    from kafka2pc._exceptions import BrokerUnavailableError, UsageError

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


class _Kafka2pcGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            if ctx.meta.get(_META + "debug"):
                raise
            code, message = classify(exc)
            raise _ExitWithMessage(message, int(code)) from exc


@click.group(cls=_Kafka2pcGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kafka2pc")
@_connection_options(group=True)
def cli() -> None:
    """Inspect and settle Kafka transactions, including in-doubt two-phase-commit ones.

    Exit codes: 0 ok, 1 failure, 2 usage, 3 heuristic outcome found, 4 unknown
    transactional id, 5 Kafka unreachable, 6 authorization failure, 7 database
    error, 8 unsupported by the broker, 9 outcome not known yet (see docs/cli.md).
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
        infos = admin.list_transactions(min_open_ms=min_open, states=states)
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


@cli.command("describe")
@click.argument("transactional_id")
@_output_option
@_connection_options(group=False)
def describe_command(transactional_id: str, output: str) -> None:
    """One transaction: state, producer id/epoch, age, and per partition the LSO it pins."""
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
@click.argument("transactional_id")
@click.argument("state")
@click.option("--dry-run", is_flag=True, help="Only say what would be done.")
@_connection_options(group=False)
def complete_command(transactional_id: str, state: str, dry_run: bool) -> None:
    """Commit the open transaction iff STATE names it (the stored prepared state), else abort it.

    STATE is the text of a PreparedTxnState (k2pc1:..., or '-1:-1' for none).
    Afterwards the producer is fenced (its epoch bumped).  Exit code 3 if Kafka
    had already aborted the transaction STATE names (a heuristic outcome).
    """
    from kafka2pc._state import PreparedTxnState

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
@click.argument("transactional_id")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@_connection_options(group=False)
def force_terminate_command(transactional_id: str, yes: bool) -> None:
    """Abort whatever transaction TRANSACTIONAL_ID has open and fence its producer (KIP-939).

    Its records never become visible; the producer that opened it (or a
    recovering one) gets ProducerFenced.  If a database committed that
    transaction's prepared state, this makes the outcome heuristic: prefer
    'kafka2pc complete' or 'kafka2pc recover'.
    """
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
        after = admin.control_plane.describe_transaction(transactional_id)
    new_epoch = "?" if after is None else str(after.producer_epoch)
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


# -- in-doubt / recover -------------------------------------------------------------------


def _db_options(func: _F) -> _F:
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


def _report(*, settle: bool, dry_run: bool, db_url: str, table: str) -> tuple[dict[str, Any], ExitCode]:
    """Plan (and with ``settle``, carry out) recovery for every row; the JSON report and the exit code."""
    settings = _settings()
    _configure_logging(settings.debug)
    from kafka2pc._exceptions import IndefiniteOutcomeError, UsageError
    from kafka2pc._state import PreparedTxnState

    from ._statedb import RowLocks, masked_url, read_states

    rows: list[StoredState] = read_states(db_url, table, timeout_s=settings.timeout_s)
    entries: list[dict[str, Any]] = []
    settled_states: dict[str, PreparedTxnState] = {}
    indefinite = False
    locks = RowLocks(db_url, table, timeout_s=settings.timeout_s) if settle and not dry_run else None
    with _admin() as admin, contextlib.ExitStack() as cleanup:
        if locks is not None:
            cleanup.callback(locks.close)
        for row in rows:
            entry: dict[str, Any] = {
                "transactional_id": row.transactional_id,
                "stored_state": row.prepared_txn_state,
                "updated_at": row.updated_at,
                "kafka_state": None,
                "producer_id": None,
                "producer_epoch": None,
                "open_for_ms": None,
                "decision": None,
                "heuristic": False,
                "stored_outcome": None,
                "outcome": None,
                "reason": None,
                "error": None,
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
                        if admin.plan_recovery(row.transactional_id, state).decision.value != "nothing":
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
                _fill_kafka_fields(entry, admin.control_plane.describe_transaction(row.transactional_id))
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
        for entry in entries:
            if entry["outcome"] == "unknown" and entry["transactional_id"] in settled_states:
                again = admin.plan_recovery(entry["transactional_id"], settled_states[entry["transactional_id"]])
                entry["outcome"] = again.stored_outcome.value
                entry["heuristic"] = again.heuristic
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


def _report_text(document: dict[str, Any], *, settled: bool) -> str:
    headers = ["TRANSACTIONAL ID", "KAFKA STATE", "PRODUCER", "OPEN FOR", "DECISION"]
    headers += ["STORED TXN", "REASON"] if not settled else ["STORED TXN NOW", "REASON"]
    rows = []
    for entry in document["entries"]:
        producer = "-" if entry["producer_id"] is None else f"{entry['producer_id']}/{entry['producer_epoch']}"
        decision = entry["decision"] or "error"
        if entry["heuristic"]:
            decision += " + HEURISTIC"
        stored = entry["outcome"] if settled else entry["stored_outcome"]
        rows.append([
            entry["transactional_id"], entry["kafka_state"] or "unknown id", producer,
            format_duration(entry["open_for_ms"]), decision, stored or "-", entry["error"] or entry["reason"],
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
def in_doubt_command(db_url: str, table: str, output: str) -> None:
    """What recovery would do for each prepared state stored by the dual-write recipe.

    Joins the state table with the coordinator's view: per transactional id
    its Kafka state, how long it has been open, and the decision (commit,
    abort, nothing; HEURISTIC when Kafka aborted a transaction the database
    committed).  Changes nothing.  Exit code 3 if a heuristic outcome is found.
    """
    document, code = _report(settle=False, dry_run=False, db_url=db_url, table=table)
    click.echo(dump_json(document) if output == "json" else _report_text(document, settled=False))
    if code is not ExitCode.OK:
        click.get_current_context().exit(int(code))


@cli.command("recover")
@_db_options
@click.option("--dry-run", is_flag=True, help="Only say what would be done (same as in-doubt).")
@_output_option
@_connection_options(group=False)
def recover_command(db_url: str, table: str, dry_run: bool, output: str) -> None:
    """Settle every prepared transaction stored by the dual-write recipe.

    Per row: commit the open transaction if it is the stored prepared one,
    else abort it; then fence the producer.  Run it while the application's
    producers are stopped.  The table is only read.  Exit code 3 if a
    heuristic outcome is found, 9 if an outcome is not known yet (run again).
    """
    document, code = _report(settle=True, dry_run=dry_run, db_url=db_url, table=table)
    click.echo(dump_json(document) if output == "json" else _report_text(document, settled=not dry_run))
    if code is not ExitCode.OK:
        click.get_current_context().exit(int(code))


def main() -> None:
    """Console-script entry point (``kafka2pc``)."""
    cli(prog_name="kafka2pc")
