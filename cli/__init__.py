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
the group's ``invoke`` (:mod:`kafka2pc.cli._group`).  ``--debug`` shows
tracebacks and library logs.

One module per group of commands: :mod:`._transactions` (list, describe,
complete, force-terminate), :mod:`._partitions` (describe-producers,
find-hanging, abort), :mod:`._recovery` (in-doubt, recover) and
:mod:`._stats` (stats, pending-offsets, ``--watch``); the policy for stuck
transactions is :mod:`._stuck` (``stuck``; ``find-hanging --older-than`` is its
deprecated spelling), the OpenTelemetry exporter :mod:`._otel` (``stats --otel``)
and the Prometheus endpoint :mod:`._prometheus` (``stats --prometheus``); :mod:`._options`
holds what the commands share, :mod:`._probe` the fast unreachable check.
"""

from __future__ import annotations

from kafka2pc._extras import missing_extra

try:
    import click  # noqa: F401  (the extra's one dependency: fail here, with its name)
except ImportError as exc:
    raise missing_extra(exc, extra="cli", feature="the kafka2pc command line") from exc

from . import _partitions, _recovery, _stats, _stuck, _transactions  # noqa: F401  (each registers its commands on cli)
from ._errors import ExitCode
from ._group import cli

__all__ = ["ExitCode", "cli", "main"]


def main() -> None:
    """Console-script entry point (``kafka2pc``)."""
    cli(prog_name="kafka2pc")
