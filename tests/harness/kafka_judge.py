"""Kafka's own judge of "nothing left open": Apache Kafka's ``TransactionsCommand``, beside kafka2pc's view.

A crash test that asks only kafka2pc whether kafka2pc left a transaction open judges itself. This module
asks Kafka's own command-line tool (``kafka-transactions.sh``'s main class, from
``org.apache.kafka:kafka-tools``), which shares no code with kafka2pc:

- ``list`` (filtered to the test's ids): the coordinators' state of every transactional id of the test; any
  not in a finished state (``Empty``, ``CompleteCommit``, ``CompleteAbort``) is open;
- ``find-hanging --broker-id <id> --max-transaction-timeout 0``: on each broker, the transactions open on a
  partition that their coordinator does not know as open (what pins a last stable offset for good).

The jars are fetched once from Maven Central into ``~/.cache/kafka2pc/maven/kafka-tools-<version>/libs``
(:func:`kafka2pc.testing.kafka_tools.fetch_tools`). Each call starts two JVMs at once (about 1-2 s on a loaded
2-core machine): call :func:`assert_nothing_open` once per test, at its end, not per cell.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kafka2pc.testing.kafka_tools import fetch_tools, parse_table

#: The kafka-tools release: the newest on Maven Central (its TransactionsCommand talks to every broker line).
TOOLS_VERSION = "4.4.0"
MAIN = "org.apache.kafka.tools.TransactionsCommand"
#: Coordinator states of a transactional id with nothing open.
FINISHED_STATES = frozenset({"Empty", "CompleteCommit", "CompleteAbort", "Dead"})
#: Coordinator states of a transaction whose outcome is decided and whose markers are being written.
COMPLETING_STATES = frozenset({"PrepareCommit", "PrepareAbort"})
COMPLETING_RETRIES = 3
TIMEOUT_S = 120.0
"""Bound on one run of the tool (a JVM start plus a few admin requests)."""


@dataclass(frozen=True)
class Verdict:
    """What Kafka's tool found: the test's transactional ids and their states, and the hanging transactions."""

    states: dict[str, str]
    hanging: list[dict[str, str]]

    @property
    def still_open(self) -> dict[str, str]:
        return {tid: state for tid, state in self.states.items() if state not in FINISHED_STATES}


def tools_libs() -> Path:
    """The kafka-tools jars (fetched on first use)."""
    return fetch_tools(TOOLS_VERSION)


def _java() -> str:
    """The brokers' Java (``$JAVA_HOME`` first, as ``kafka2pc.testing`` finds it)."""
    home = os.environ.get("JAVA_HOME")
    return str(Path(home, "bin", "java")) if home and Path(home, "bin", "java").exists() else "java"


def _command(bootstrap: str, *args: str) -> list[str]:
    return [_java(), "-cp", f"{tools_libs()}/*", MAIN, "--bootstrap-server", bootstrap, *args]


def _table(output: str) -> list[dict[str, str]]:
    """The rows of the tool's table (its header names the columns; cells end with a tab)."""
    return parse_table(output)


def _broker_ids(bootstrap: str) -> list[int]:
    """The cluster's brokers, asked of plain confluent-kafka (not of kafka2pc)."""
    from confluent_kafka.admin import AdminClient

    metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30)
    return sorted(metadata.brokers)


def judge(
    bootstrap: str, transactional_ids: Iterable[str] | None = None, *, prefix: str | Iterable[str] | None = None,
    topics: Iterable[str] | None = None,
) -> Verdict:
    """Run the tool: the states of the given ids (and of every id starting with ``prefix``, one or several), and the hanging
    transactions on every broker (on ``topics`` only, when given). Raises when the tool fails."""
    ids = sorted(set(transactional_ids or ()))
    prefixes = [prefix] if isinstance(prefix, str) else list(prefix or ())
    if not ids and not prefixes:
        raise ValueError("judge: name the transactional ids or their prefix")
    pattern = "|".join([re.escape(i) for i in ids] + [re.escape(p) + ".*" for p in prefixes])
    env = {**os.environ, "JAVA_TOOL_OPTIONS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xshare:auto"}
    # Every id, filtered here: brokers before Kafka 3.8 (ListTransactions v1) refuse --transactional-id-pattern.
    runs = {"list": _command(bootstrap, "list")}
    for broker in _broker_ids(bootstrap):
        runs[f"find-hanging {broker}"] = _command(bootstrap, "find-hanging", "--broker-id", str(broker),
                                                  "--max-transaction-timeout", "0")
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for name, cmd in runs.items()}
    outputs: dict[str, str] = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise AssertionError(f"TransactionsCommand {name} gave no answer in {TIMEOUT_S:.0f} s") from None
        if proc.returncode != 0:
            raise AssertionError(f"TransactionsCommand {name} exited {proc.returncode}:\n{out}\n{err[-3000:]}")
        outputs[name] = out
    wanted_id = re.compile(f"^({pattern})$")
    states = {row["TransactionalId"]: row["TransactionState"] for row in _table(outputs.pop("list"))
              if wanted_id.match(row["TransactionalId"])}
    wanted = set(topics) if topics is not None else None
    hanging = [row for out in outputs.values() for row in _table(out)
               if wanted is None or row.get("Topic") in wanted]
    return Verdict(states, hanging)


def assert_nothing_open(
    bootstrap: str, transactional_ids: Iterable[str] | None = None, *, prefix: str | Iterable[str] | None = None,
    topics: Iterable[str] | None = None,
) -> Verdict:
    """Kafka's tool finds none of the test's transactional ids open and no hanging transaction (see
    :func:`judge`); returns the verdict (``states`` lists the ids it judged).

    A transaction in ``PrepareCommit`` or ``PrepareAbort`` is being completed (its markers are on their
    way): it is judged again, up to ``COMPLETING_RETRIES`` times, a second apart. ``Ongoing`` is open.
    """
    ids = list(transactional_ids or ())
    verdict = judge(bootstrap, ids, prefix=prefix, topics=topics)
    for _ in range(COMPLETING_RETRIES):
        if not verdict.still_open or set(verdict.still_open.values()) - COMPLETING_STATES:
            break
        time.sleep(1.0)
        verdict = judge(bootstrap, ids, prefix=prefix, topics=topics)
    assert not verdict.still_open, f"Kafka's TransactionsCommand lists open transactions: {verdict.still_open}"
    assert not verdict.hanging, f"Kafka's TransactionsCommand find-hanging: {verdict.hanging}"
    return verdict
