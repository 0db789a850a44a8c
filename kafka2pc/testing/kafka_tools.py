"""Apache Kafka's own ``TransactionsCommand``, as an independent judge for tests.

A test that asks only kafka2pc whether kafka2pc left a transaction open judges
itself.  Kafka's ``kafka-transactions.sh`` (the ``TransactionsCommand`` class of
``org.apache.kafka:kafka-tools``) is a second opinion written by others:
:func:`transactions_command` runs it against a cluster and parses its table.

The jars come from Maven Central through the same fetch as the broker's
(:mod:`kafka2pc.testing._fetch`: one Maven at a time, into
``~/.cache/kafka2pc/maven/kafka-tools-<version>/libs``, reused once complete).
Nothing in kafka2pc needs them; only tests do.

Example::

    rows = transactions_command(bootstrap, "find-hanging", "--topic", topic,
                                "--max-transaction-timeout", "0")
    assert rows == []                  # no hanging transaction on the topic
    [row] = transactions_command(bootstrap, "describe", "--transactional-id", "orders-1")
    assert row["TransactionState"] in ("Empty", "CompleteCommit", "CompleteAbort")
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from kafka2pc.testing._common import BrokerError, cache_dir
from kafka2pc.testing._fetch import _maven_fetch

__all__ = [
    "TOOLS_VERSION",
    "TRANSACTIONS_COMMAND",
    "TransactionsCommandError",
    "fetch_tools",
    "parse_table",
    "transactions_command",
]

TOOLS_VERSION = "4.4.0"
"""The ``kafka-tools`` release fetched here (the broker line the suite runs by default)."""

TRANSACTIONS_COMMAND = "org.apache.kafka.tools.TransactionsCommand"

TRANSACTIONS_COMMAND_TIMEOUT_S = 120.0
"""Bound of one ``TransactionsCommand`` run (a JVM start on a loaded machine takes seconds)."""


class TransactionsCommandError(BrokerError):
    """``TransactionsCommand`` failed (non-zero exit) or did not finish within its bound."""


def fetch_tools(version: str = TOOLS_VERSION) -> Path:
    """Download ``org.apache.kafka:kafka-tools:<version>`` and its dependencies; return the libs directory.

    Idempotent: a complete download is reused.  Raises :class:`BrokerError`
    when Maven is missing or cannot fetch the artifacts.
    """
    deps = [
        ("org.apache.kafka", "kafka-tools", version),
        # The tools log through slf4j; a binding keeps its "no provider" warning off stderr.
        ("org.slf4j", "slf4j-nop", "1.7.36"),
    ]
    return _maven_fetch(cache_dir() / "maven" / f"kafka-tools-{version}" / "libs", deps, f"kafka-tools {version}")


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of a ``TransactionsCommand`` table (header line, then one line per row), keyed by header.

    The tool pads each cell with spaces and ends each with a tab, so cells are split on tabs, never on
    spaces: a transactional id may contain spaces (Kafka allows any string). Lines before the header
    (none is expected) and blank lines are ignored.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    header_at = next((i for i, line in enumerate(lines) if line.split() and line.split()[0] in _FIRST_HEADERS), None)
    if header_at is None:
        return []
    headers = _cells(lines[header_at])
    rows = []
    for line in lines[header_at + 1:]:
        cells = _cells(line)
        if len(cells) != len(headers):
            raise TransactionsCommandError(f"TransactionsCommand printed a row of another shape: {line!r}")
        rows.append(dict(zip(headers, cells, strict=True)))
    return rows


def _cells(line: str) -> list[str]:
    cells = [cell.strip() for cell in line.split("\t")]
    return cells[:-1] if len(cells) > 1 and cells[-1] == "" else cells


_FIRST_HEADERS = frozenset({"TransactionalId", "CoordinatorId", "Topic", "ProducerId"})


def transactions_command(
    bootstrap_servers: str, *args: str, version: str = TOOLS_VERSION, timeout_s: float = TRANSACTIONS_COMMAND_TIMEOUT_S
) -> list[dict[str, str]]:
    """Run ``kafka-transactions.sh --bootstrap-server B ARGS...`` and return its table's rows.

    ``args`` is the sub-command and its options: ``list``, ``describe
    --transactional-id ID``, ``find-hanging --topic T [--partition N]
    [--max-transaction-timeout MINUTES]`` or ``--broker-id ID``...  Raises
    :class:`TransactionsCommandError` on a non-zero exit (with its stderr)
    or past ``timeout_s``.
    """
    java = shutil.which("java")
    if java is None:
        raise TransactionsCommandError("java is needed to run Kafka's TransactionsCommand")
    libs = fetch_tools(version)
    command = [java, "-Xmx256m", "-XX:TieredStopAtLevel=1", "-cp", f"{libs}/*", TRANSACTIONS_COMMAND,
               "--bootstrap-server", bootstrap_servers, *args]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise TransactionsCommandError(f"TransactionsCommand {' '.join(args)} ran past {timeout_s:g} s") from exc
    if proc.returncode != 0:
        raise TransactionsCommandError(
            f"TransactionsCommand {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}"
        )
    return parse_table(proc.stdout)
