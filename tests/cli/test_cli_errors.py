"""Failures end as one actionable line and a documented exit code (tracebacks only with --debug)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from harness.ports import closed_port
from kafka2pc.cli._errors import ExitCode


def one_line_error(run: Any) -> str:
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), run
    assert "Traceback" not in run.stderr
    return str(lines[0])


CLOSE_S = 1.0
"""docs/cli.md: a command against a silent cluster ends within --timeout plus this (closing its connections).

Measured from the command's start, after Python's start-up and imports, which
take seconds of their own on a loaded machine (conftest.run_cli_timed)."""

COMMANDS = (
    ["list"], ["describe", "x"], ["stats"], ["pending-offsets"], ["stuck", "--older-than", "30m"],
    ["describe-producers", "--topic", "t", "--partition", "0"], ["force-terminate", "x", "--yes"],
    ["complete", "x", "-1:-1"],
)


@contextlib.contextmanager
def silent_broker() -> Iterator[str]:
    """A listener that accepts TCP connections and never answers: what a stopped (SIGSTOPped) broker looks like."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def test_unreachable_cluster_fails_at_once_in_plain_words(
    run_kafka2pc: Callable[..., Any], run_kafka2pc_timed: Callable[..., Any]
) -> None:
    refused = f"127.0.0.1:{closed_port()}"
    unknown_host = "no-such-broker.invalid:9092"
    cases = [(args, refused, "connection refused") for args in COMMANDS]
    cases += [(args, unknown_host, "cannot resolve host name") for args in (["list"], ["stats"])]
    for args, address, why in cases:
        run, seconds = run_kafka2pc_timed("--timeout", "30", *args, "-b", address)
        assert run.returncode == ExitCode.UNREACHABLE, run
        line = one_line_error(run)
        assert line.startswith(f"Error: Kafka unreachable: {address}: {why}"), run
        assert "control plane" not in line and "KafkaTimeoutError" not in line, run
        assert seconds < CLOSE_S, (seconds, run)  # at once: no wait for --timeout (30 s here)

    debug = run_kafka2pc("--timeout", "1", "describe", "x", "--bootstrap-server", refused, "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "CliFailure" in debug.stderr


def test_a_silent_broker_fails_within_the_timeout(run_kafka2pc_timed: Callable[..., Any], tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE kafka_transaction_state (transactional_id VARCHAR(255) PRIMARY KEY, "
                             "prepared_txn_state VARCHAR(255), updated_at TIMESTAMP)"))
        conn.execute(sa.text("INSERT INTO kafka_transaction_state VALUES ('x', '', CURRENT_TIMESTAMP)"))
    engine.dispose()
    with silent_broker() as address:
        for args in (["list"], ["stats"], ["stuck", "--older-than", "30m"],
                     ["describe-producers", "--topic", "t", "--partition", "0"],
                     ["in-doubt", "--db-url", f"sqlite:///{db}"]):
            run, seconds = run_kafka2pc_timed("--timeout", "2", *args, "-b", address)
            assert run.returncode == ExitCode.UNREACHABLE, run
            line = one_line_error(run)
            assert f"no answer from {address} within --timeout 2 s" in line, run
            assert "control plane" not in line and "KafkaTimeoutError" not in line, run
            assert seconds < 2 + CLOSE_S, (seconds, run)  # the documented bound, far below the 15 s default


def test_unknown_transactional_id(kafka_cli: Callable[..., Any]) -> None:
    for args in (["describe", "never-used-id"], ["force-terminate", "never-used-id", "--yes"],
                 ["complete", "never-used-id", "-1:-1"]):
        run = kafka_cli(*args)
        assert run.returncode == ExitCode.NOT_FOUND, run
        assert "unknown transactional id 'never-used-id'" in one_line_error(run)


def test_connection_options_before_after_and_from_the_environment(
    kafka_bootstrap: str, run_kafka2pc: Callable[..., Any]
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    # --timeout 60: what is tested is where the options may go; a loaded CI machine has kept the broker
    # from answering for more than 10 s.
    before = run_kafka2pc("--bootstrap-server", kafka_bootstrap, "--timeout", "60", "list", "--min-open", "1d", env=env)
    after = run_kafka2pc("list", "--min-open", "1d", "--bootstrap-server", kafka_bootstrap, "--timeout", "60", env=env)
    from_env = run_kafka2pc(
        "list", "--min-open", "1d", "--timeout", "60", env={**env, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    )
    overridden = run_kafka2pc(  # the value after the command wins over the environment
        "list", "--bootstrap-server", kafka_bootstrap, "--timeout", "60",
        env={**env, "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{closed_port()}"},
    )
    for run in (before, after, from_env, overridden):
        assert run.returncode == 0, run
    missing = run_kafka2pc("list", env=env)
    assert missing.returncode == ExitCode.USAGE and "no bootstrap server" in one_line_error(missing)


def test_usage_errors(kafka_cli: Callable[..., Any]) -> None:
    assert kafka_cli("list", "--min-open", "soon").returncode == ExitCode.USAGE
    assert kafka_cli("list", "--state", "Sleeping").returncode == ExitCode.USAGE
    assert kafka_cli("in-doubt").returncode == ExitCode.USAGE  # --db-url is required
    malformed = kafka_cli("complete", "some-id", "not-a-state")
    assert malformed.returncode == ExitCode.USAGE and "malformed prepared state" in one_line_error(malformed)


def test_database_errors(
    tmp_path: Path, pg_url: str, sqlite_url: str, kafka_cli: Callable[..., Any]
) -> None:
    missing_file = tmp_path / "absent.db"
    run = kafka_cli("in-doubt", "--db-url", f"sqlite:///{missing_file}")
    assert run.returncode == ExitCode.DATABASE and "does not exist" in one_line_error(run)
    assert not missing_file.exists()  # reading never creates a database

    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE unrelated (x INTEGER)"))
    engine.dispose()
    run = kafka_cli("recover", "--db-url", sqlite_url, "--table", "kafka_transaction_state")
    assert run.returncode == ExitCode.DATABASE and "table 'kafka_transaction_state' not found" in one_line_error(run)
    run = kafka_cli("in-doubt", "--db-url", sqlite_url, "--table", "unrelated")  # wrong columns
    assert run.returncode == ExitCode.DATABASE and "transactional_id" in one_line_error(run)

    url = sa.make_url(pg_url)
    wrong_password = url.set(password="not-the-password").render_as_string(hide_password=False)
    run = kafka_cli("in-doubt", "--db-url", wrong_password)
    assert run.returncode == ExitCode.DATABASE and "password authentication failed" in one_line_error(run)
    assert "not-the-password" not in run.stderr
    unreachable = url.set(port=closed_port()).render_as_string(hide_password=False)
    run = kafka_cli("in-doubt", "--db-url", unreachable, "--timeout", "3")
    assert run.returncode == ExitCode.DATABASE and "database error" in one_line_error(run)
    run = kafka_cli("in-doubt", "--db-url", "not a url")
    assert run.returncode == ExitCode.DATABASE, run


BAD_COMMAND_LINES = (
    ["nope"], ["list", "--foo"], ["list", "--min-open", "soon"], ["list", "--state", "Sleeping"], ["in-doubt"],
    ["describe"], ["stats", "--watch", "0"], ["stats", "--count", "0"], ["stats", "--prometheus", "nowhere"],
    ["stats", "--otel", "--prometheus", ":9464"], ["stuck"], ["stuck", "--older-than", "1h", "--yes"],
    ["stuck", "--older-than", "1h", "--abort"], ["find-hanging"], ["abort", "--topic", "t"],
    ["--timeout", "abc", "list"], ["complete", "x"], ["describe-producers", "--topic", "t"],
    ["find-hanging", "--max-transaction-timeout", "later", "--topic", "t"], ["list", "-o", "yaml"],
)


def test_every_usage_error_is_one_line(run_kafka2pc: Callable[..., Any]) -> None:
    refused = f"127.0.0.1:{closed_port()}"  # a command line that parsed would fail with exit code 5 instead
    for args in BAD_COMMAND_LINES:
        run = run_kafka2pc(*args, "-b", refused) if args != ["nope"] else run_kafka2pc(*args)
        assert run.returncode == ExitCode.USAGE, run
        one_line_error(run)
        assert "Usage:" not in run.stderr and "Try '" not in run.stderr, run


def test_one_duration_syntax(kafka_cli: Callable[..., Any], topic_factory: Callable[..., str]) -> None:
    """``90``, ``90s``, ``15m`` and ``2h`` wherever a duration goes; a plain number is seconds."""
    topic = topic_factory()
    for duration in ("90", "90s", "15m", "2h"):
        for args in (["list", "--min-open", duration], ["stuck", "--older-than", duration],
                     ["find-hanging", "--topic", topic, "--max-transaction-timeout", duration],
                     ["stats", "--watch", duration, "--count", "1"]):
            run = kafka_cli("--timeout", duration, *args)
            assert run.returncode == 0, run
    listed = kafka_cli("find-hanging", "--topic", topic, "--max-transaction-timeout", "90", "-o", "json")
    assert listed.json()["max_transaction_timeout_ms"] == 90_000, listed
    stuck = kafka_cli("stuck", "--older-than", "2h", "-o", "json")
    assert stuck.json()["older_than_ms"] == 7_200_000, stuck


def _exports(stdout: str) -> list[dict[str, Any]]:
    import json

    decoder, docs, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(stdout) and stdout[at].isspace():
            at += 1
        if at >= len(stdout):
            return docs
        doc, at = decoder.raw_decode(stdout, at)
        docs.append(doc)


def test_a_failed_collection_is_logged_at_error_and_counted(run_kafka2pc: Callable[..., Any]) -> None:
    """``stats --otel`` and ``--prometheus`` against a silent broker: one ERROR line each, without --debug."""
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    with silent_broker() as address:
        run = run_kafka2pc("--timeout", "2", "stats", "--otel", "--count", "1", "-b", address)
        assert run.returncode == 0, run
        errors = [line for line in run.stderr.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "collection failed: Kafka unreachable" in errors[0], run
        [export] = _exports(run.stdout)
        points = {m["name"]: [p["value"] for p in m["data"]["data_points"]]
                  for r in export["resource_metrics"] for s in r["scope_metrics"] for m in s["metrics"]}
        assert points.pop("kafka2pc.cluster.collection.failures") == [1], points
        assert not any(points.values()), points  # no stale figures

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        proc = subprocess.Popen([str(Path(sys.executable).parent / "kafka2pc"), "--timeout", "2", "stats", "--prometheus", f"127.0.0.1:{port}",
                                 "--watch", "60", "-b", address], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            deadline, text = time.monotonic() + 60, ""
            while "kafka2pc_cluster_collection_failures_total 1.0" not in text:
                assert time.monotonic() < deadline and proc.poll() is None, text
                time.sleep(0.5)
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:  # noqa: S310
                        text = answer.read().decode()
                except OSError:
                    continue
        finally:
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        assert "kafka2pc_cluster_partitions_held_back" not in text, text
        errors = [line for line in err.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "collection failed: Kafka unreachable" in errors[0], err
