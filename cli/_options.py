"""What every command shares: the connection options, ``-o``, durations, and the admin they open.

The connection options are accepted both before and after the command name
(``kafka2pc -b X list`` and ``kafka2pc list -b X``) and stored in
``ctx.meta``; :func:`admin` opens a :class:`kafka2pc.TransactionAdmin` for the
values in effect, after :func:`kafka2pc.cli._probe.preflight` has failed fast
on a bootstrap address that refuses connections or does not resolve.
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

from ._errors import CliFailure, ExitCode
from ._render import parse_duration_s

if TYPE_CHECKING:
    from kafka2pc import TransactionAdmin

__all__ = [
    "COORDINATOR_STATES",
    "DEFAULT_STATE_TABLE",
    "DEFAULT_CLI_TIMEOUT_S",
    "DURATION",
    "META",
    "Duration",
    "Settings",
    "open_admin",
    "parse_listen_address",
    "configure_logging",
    "connection_options",
    "one_transactional_id",
    "output_option",
    "current_settings",
    "transactional_id_option",
    "unknown_id",
]

_F = TypeVar("_F", bound=Callable[..., Any])

DEFAULT_CLI_TIMEOUT_S = 15.0
"""The bound of one command's calls to the cluster when ``--timeout`` is not given."""
DEFAULT_STATE_TABLE = "kafka_transaction_state"
"""The dual write's state table (``kafka2pc.recipes.dual_write``'s default name)."""
COORDINATOR_STATES = (
    "Empty", "Ongoing", "PrepareCommit", "PrepareAbort", "CompleteCommit", "CompleteAbort", "Dead",
    "PrepareEpochFence",
)
META = "kafka2pc.cli."


# -- options shared by the group and every command -----------------------------------


def _remember(name: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """Store an option's value in ``ctx.meta`` (shared by the group and its commands).

    The connection options are accepted both before and after the command name
    (``kafka2pc --bootstrap-server X list`` and ``kafka2pc list --bootstrap-server X``);
    the command's value, parsed last, wins.
    """

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None and value is not False:
            ctx.meta[META + name] = value
        return value

    return callback


def connection_options(*, group: bool) -> Callable[[_F], _F]:
    def decorate(func: _F) -> _F:
        options = [
            click.option(
                "--bootstrap-server", "-b", metavar="HOST:PORT[,HOST:PORT]", expose_value=False,
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
                "--timeout", metavar="DURATION", type=Duration(min_s=0.1), expose_value=False,
                callback=_remember("timeout"),
                help=f"Give up on an unreachable cluster after this long [default: {DEFAULT_CLI_TIMEOUT_S:g}].",
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


def output_option(func: _F) -> _F:
    return click.option(
        "--output", "-o", type=click.Choice(["table", "json"]), default="table", show_default=True,
        help="Human-readable table, or JSON (shape: https://kafka2pc.github.io/kafka2pc/cli/).",
    )(func)


class Duration(click.ParamType):  # type: ignore[type-arg]  # generic in click 8.2+, not in 8.1
    """Every duration option's one syntax: ``90`` (seconds), ``90s``, ``15m``, ``2h``.

    Also ``500ms``, ``1d`` and ``1h30m``.

    The value is a float number of seconds.  ``min_s`` is the smallest accepted.
    """

    name = "duration"

    def __init__(self, min_s: float = 0.0) -> None:
        self.min_s = min_s

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = float(value)
        else:
            try:
                seconds = parse_duration_s(str(value))
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
        if seconds < self.min_s:
            self.fail(f"{value!r} is shorter than {self.min_s:g} s", param, ctx)
        return seconds


DURATION = Duration()


def parse_listen_address(text: str) -> tuple[str, int]:
    """``":9464"`` -> ``("0.0.0.0", 9464)``; ``"127.0.0.1:9464"`` -> ``("127.0.0.1", 9464)``.

    Raises :class:`ValueError` for anything else (a port outside 1-65535, no port).
    """
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not [HOST]:PORT (examples: :9464, 127.0.0.1:9464)")
    return (host.strip("[]") or "0.0.0.0"), int(port)


@dataclass(frozen=True)
class Settings:
    bootstrap_server: str | None
    command_config: str | None
    timeout_s: float
    debug: bool


def current_settings() -> Settings:
    meta = click.get_current_context().meta
    return Settings(
        bootstrap_server=meta.get(META + "bootstrap_server"),
        command_config=meta.get(META + "command_config"),
        timeout_s=float(meta.get(META + "timeout", DEFAULT_CLI_TIMEOUT_S)),
        debug=bool(meta.get(META + "debug", False)),
    )


def configure_logging(debug: bool) -> None:
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
    if not debug:
        # What the CLI's own long-running modes log at ERROR (a failed stats --otel/--prometheus
        # collection) is for the operator: on stderr, one line each, without --debug.
        cli_log = logging.getLogger("kafka2pc.cli")
        if not any(getattr(h, "_kafka2pc_cli", False) for h in cli_log.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setLevel(logging.ERROR)
            handler.setFormatter(logging.Formatter("%(asctime)s ERROR %(message)s", "%Y-%m-%dT%H:%M:%SZ"))
            handler.formatter.converter = time.gmtime  # type: ignore[union-attr]
            handler._kafka2pc_cli = True  # type: ignore[attr-defined]
            cli_log.addHandler(handler)


@contextlib.contextmanager
def open_admin() -> Iterator[TransactionAdmin]:
    """A :class:`TransactionAdmin` for the connection options in effect (imported here: heavy)."""
    settings = current_settings()
    configure_logging(settings.debug)
    from kafka2pc import BrokerUnavailableError, TransactionAdmin, UsageError

    from ._config import client_config, read_properties

    try:
        properties = read_properties(settings.command_config) if settings.command_config else {}
        config = client_config(settings.bootstrap_server, properties)
        admin = TransactionAdmin(config, timeout_s=settings.timeout_s, request_timeout_s=settings.timeout_s)
    except UsageError as exc:
        if not settings.command_config or str(exc).startswith("--command-config"):
            raise
        raise type(exc)(f"--command-config {settings.command_config}: {exc}") from exc
    from ._probe import diagnose_unreachable, preflight, unreachable

    try:
        refused = preflight(str(config["bootstrap.servers"]), settings.timeout_s)
        if refused is not None:
            raise refused
        yield admin
    except BrokerUnavailableError as exc:
        precise = diagnose_unreachable(config, settings.timeout_s)
        if precise is not None:
            raise precise from exc
        raise unreachable(
            f"no answer from {config['bootstrap.servers']} within --timeout {settings.timeout_s:g} s"
        ) from exc
    finally:
        admin.close()


def unknown_id(transactional_id: str) -> CliFailure:
    return CliFailure(
        f"unknown transactional id {transactional_id!r}: the cluster's transaction coordinator has no "
        "record of it (never used, or expired after transactional.id.expiration.ms)",
        ExitCode.NOT_FOUND,
    )


def transactional_id_option(func: _F) -> _F:
    return click.option(
        "--transactional-id", "transactional_id_option", metavar="ID",
        help="The transactional id, as kafka-transactions.sh takes it (instead of the TRANSACTIONAL_ID argument).",
    )(func)


def one_transactional_id(positional: str | None, option: str | None) -> str:
    """The id given as the TRANSACTIONAL_ID argument or as ``--transactional-id`` (not two different ones)."""
    if positional is not None and option is not None and positional != option:
        raise click.UsageError(f"two transactional ids: {positional!r} and --transactional-id {option!r}")
    chosen = option if option is not None else positional
    if chosen is None:
        raise click.UsageError("missing the transactional id (TRANSACTIONAL_ID or --transactional-id ID)")
    return chosen
