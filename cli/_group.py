"""The ``kafka2pc`` click group: the one place where exceptions become exit codes and one line.

Every command registers itself on :data:`cli` (``_transactions``, ``_partitions``,
``_recovery``, ``_stats``); :meth:`_Kafka2pcGroup.invoke` maps what a command
lets escape through :func:`kafka2pc.cli._errors.classify`, and with ``-o json``
also prints the error as a JSON document on stdout.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import click

from kafka2pc import __version__

from ._errors import classify, error_json
from ._options import META, connection_options
from ._render import dump_json

__all__ = ["cli"]


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


def _hint(exc: click.UsageError) -> str:
    ctx = exc.ctx
    if ctx is None:
        return ""
    help_option = ctx.help_option_names[0] if ctx.help_option_names else "--help"
    return f" (see '{ctx.command_path} {help_option}')"


class _Kafka2pcGroup(click.Group):
    def main(  # type: ignore[override]  # always exits, as click's standalone mode does
        self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any
    ) -> NoReturn:
        """Click's standalone ``main``, except that every error is one line on stderr.

        Click prints a usage error on three lines (usage, a hint, the error);
        here it is ``Error: <message> (see 'kafka2pc CMD --help')``.
        """
        try:
            result = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # `kafka2pc` alone: the help, as click prints it
                exc.show()
                sys.exit(exc.exit_code)
            click.echo(f"Error: {' '.join(exc.format_message().split())}{_hint(exc)}", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"Error: {' '.join(exc.format_message().split())}", err=True)
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[META + "json"] = _wants_json(list(args))
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            try:
                return super().invoke(ctx)
            except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
                raise
            except Exception as exc:
                if ctx.meta.get(META + "debug"):
                    raise
                code, message = classify(exc)
                raise _ExitWithMessage(message, int(code)) from exc
        except click.exceptions.ClickException as exc:
            if ctx.meta.get(META + "json"):
                # Scripts read stdout: the error is a JSON document there too (schema "error").
                click.echo(dump_json(error_json(exc.exit_code, exc.format_message())))
            raise


@click.group(cls=_Kafka2pcGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kafka2pc")
@connection_options(group=True)
def cli() -> None:
    """Inspect and settle Kafka transactions, including in-doubt two-phase-commit ones.

    Exit codes: 0 ok, 1 failure, 2 usage, 3 heuristic outcome found, 4 unknown
    transactional id, 5 Kafka unreachable, 6 authorization failure, 7 database
    error, 8 unsupported by the broker, 9 outcome not known yet, 10 done with
    items left for a person (see https://kafka2pc.github.io/kafka2pc/cli/).
    With -o json an error is also a JSON document on stdout: {"version": 1,
    "error": {"exit_code": N, "name": "...", "message": "..."}}.
    """
