"""CLI conventions: JSON errors with -o json, --transactional-id as kafka-transactions.sh, help texts."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

from harness.ports import closed_port
from kafka2pc.cli._errors import ExitCode


def test_errors_are_json_on_stdout_with_o_json(
    kafka_cli: Callable[..., Any], run_kafka2pc: Callable[..., Any], documented_shape: Callable[[Any, str], None]
) -> None:
    unknown = kafka_cli("describe", f"no-such-{uuid.uuid4().hex[:8]}", "-o", "json")
    assert unknown.returncode == ExitCode.NOT_FOUND, unknown
    documented_shape(unknown.json(), "error")
    assert unknown.json()["error"] == {
        "exit_code": 4, "name": "NOT_FOUND", "message": unknown.json()["error"]["message"],
    }
    assert "unknown transactional id" in unknown.json()["error"]["message"]
    assert unknown.stderr.startswith("Error: ")  # people still get the line on stderr

    usage = kafka_cli("list", "--state", "Bogus", "--output=json")
    assert usage.returncode == ExitCode.USAGE
    documented_shape(usage.json(), "error")
    assert usage.json()["error"]["name"] == "USAGE"

    address = f"127.0.0.1:{closed_port()}"
    down = run_kafka2pc("--timeout", "1", "list", "--bootstrap-server", address, "-ojson")
    assert down.returncode == ExitCode.UNREACHABLE
    documented_shape(down.json(), "error")
    assert address in down.json()["error"]["message"]

    table = kafka_cli("describe", f"no-such-{uuid.uuid4().hex[:8]}")
    assert table.returncode == ExitCode.NOT_FOUND and table.stdout == ""  # without -o json: stderr only


def test_transactional_id_option_as_kafka_transactions_sh(
    kafka_cli: Callable[..., Any], killed_producer: Callable[..., Any], topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory()
    tid = f"cli-opt-{uuid.uuid4().hex[:8]}"
    txns = killed_producer(topic, 1, ("prepared", tid, 1))
    by_option = kafka_cli("describe", "--transactional-id", tid, "-o", "json")
    by_argument = kafka_cli("describe", tid, "-o", "json")
    assert by_option.returncode == by_argument.returncode == 0, by_option
    assert by_option.json()["transaction"]["transactional_id"] == tid
    assert kafka_cli("describe", tid, "--transactional-id", tid).returncode == 0  # the same id twice is fine

    two = kafka_cli("describe", "a", "--transactional-id", "b")
    assert two.returncode == ExitCode.USAGE and "two transactional ids" in two.stderr
    none = kafka_cli("describe")
    assert none.returncode == ExitCode.USAGE and "--transactional-id" in none.stderr

    state = txns[tid].states[0]
    dry = kafka_cli("complete", "--transactional-id", tid, state, "--dry-run")
    assert dry.returncode == 0 and "decision: commit" in dry.stdout, dry
    no_state = kafka_cli("complete", "--transactional-id", tid)
    assert no_state.returncode == ExitCode.USAGE and "STATE" in no_state.stderr
    done = kafka_cli("force-terminate", "--transactional-id", tid, "--yes")
    assert done.returncode == 0 and "aborted its Ongoing transaction" in done.stdout, done


def test_recover_help_says_what_it_writes(run_kafka2pc: Callable[..., Any]) -> None:
    text = " ".join(run_kafka2pc("recover", "--help").stdout.split())
    assert "only read" not in text
    assert "no-op UPDATE" in text and "no stored value changes" in text


def test_help_lists_the_kafka_transactions_sh_commands(run_kafka2pc: Callable[..., Any]) -> None:
    text = run_kafka2pc("--help").stdout
    for command in ("describe-producers", "find-hanging", "abort", "in-doubt"):
        assert command in text


def test_in_doubt_shows_what_is_prepared_for_how_long_and_the_decision(
    sqlite_url: str,
    kafka_cli: Callable[..., Any],
    killed_producer: Callable[..., Any],
    topic_factory: Callable[..., str],
) -> None:
    from test_cli_recover import store

    topic = topic_factory()
    tid = f"cli-indoubt-{uuid.uuid4().hex[:8]}"
    txns = killed_producer(topic, 1, ("prepared", tid, 2))
    state = txns[tid].states[0]
    store(sqlite_url, {tid: state})
    run = kafka_cli("in-doubt", "--db-url", sqlite_url)
    assert run.returncode == 0, run
    header, row = run.stdout.splitlines()[:2]
    columns = dict(zip(re.split(r"\s{2,}", header), re.split(r"\s{2,}", row)))
    from kafka2pc import PreparedTxnState

    prepared = PreparedTxnState(state)
    assert columns["TRANSACTIONAL ID"] == tid
    assert columns["PREPARED (STORED)"] == f"{prepared.producer_id}/{prepared.epoch} {topic}-0@0"  # what
    assert re.fullmatch(r"\d+(ms|s)|\d+m\d\ds", columns["OPEN FOR"]), columns  # for how long
    assert columns["DECISION"] == "commit" and columns["KAFKA STATE"] == "Ongoing"  # what recovery decides
    done = kafka_cli("force-terminate", tid, "--yes")
    assert done.returncode == 0, done
