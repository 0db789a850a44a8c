"""Unit tests (no broker): properties files, Java -> librdkafka mapping, durations, exit codes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kafka2pc.cli._config import CommandConfigError, client_config, parse_jaas_credentials, read_properties
from kafka2pc.cli._errors import CliFailure, ExitCode, classify
from kafka2pc.cli._render import format_duration, parse_duration_ms

from kafka2pc import (
    AuthorizationError,
    BrokerUnavailableError,
    FatalError,
    HeuristicOutcomeError,
    IndefiniteOutcomeError,
    InvalidPreparedStateError,
    RetriableError,
    UnsupportedBrokerError,
)
from kafka2pc._control import kafka_python_config

PLAIN = "org.apache.kafka.common.security.plain.PlainLoginModule"
SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "client.properties"
    path.write_text(text)
    return path


def test_properties_syntax(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "# comment\n! also a comment\n\n"
        "security.protocol = SASL_SSL\n"
        "sasl.mechanism:SCRAM-SHA-256\n"
        f'sasl.jaas.config={SCRAM} required \\\n    username="ops" \\\n    password="p=w:d";\n'
        "client.id=ops\\u0041\n"
        "ssl.ca.location=C\\:\\\\certs\\\\ca.pem\n",
    )
    props = read_properties(path)
    assert props == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-256",
        "sasl.jaas.config": f'{SCRAM} required username="ops" password="p=w:d";',
        "client.id": "opsA",
        "ssl.ca.location": "C:\\certs\\ca.pem",
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("security.protocol=SSL\njust words here\n", "line 2: expected 'key=value'"),
        ("=value\n", "line 1: empty property name"),
        ("a=\\u12\n", "malformed \\u escape"),
        ("a=b\\\n", "continuation at end of file"),
    ],
)
def test_malformed_properties_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(CommandConfigError, match=message.replace("\\", "\\\\")):
        read_properties(write(tmp_path, text))


def test_missing_properties_file(tmp_path: Path) -> None:
    with pytest.raises(CommandConfigError, match="no such file"):
        read_properties(tmp_path / "absent.properties")


def test_jaas_credentials() -> None:
    assert parse_jaas_credentials(f'{PLAIN} required username="alice" password="a\\"b";') == ("PLAIN", "alice", 'a"b')
    assert parse_jaas_credentials(f"{SCRAM} required username=bob password=pw;") == ("SCRAM", "bob", "pw")
    with pytest.raises(CommandConfigError, match="Krb5LoginModule"):
        parse_jaas_credentials("com.sun.security.auth.module.Krb5LoginModule required useKeyTab=true;")
    with pytest.raises(CommandConfigError, match="needs password"):
        parse_jaas_credentials(f'{PLAIN} required username="alice";')
    with pytest.raises(CommandConfigError, match="expected"):
        parse_jaas_credentials("not jaas at all")


def test_client_config_maps_java_names() -> None:
    config = client_config(
        "k1:9093,k2:9093",
        {
            "bootstrap.servers": "ignored:1",
            "security.protocol": "sasl_ssl",
            "sasl.jaas.config": f'{PLAIN} required username="alice" password="secret";',
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": "/etc/ca.pem",
            "ssl.endpoint.identification.algorithm": "",
            "client.id": "ops",
        },
    )
    assert config == {
        "bootstrap.servers": "k1:9093,k2:9093",
        "ssl.ca.location": "/etc/ca.pem",
        "security.protocol": "SASL_SSL",
        "ssl.endpoint.identification.algorithm": "none",
        "client.id": "ops",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "alice",
        "sasl.password": "secret",
    }
    # ...and the control plane accepts the result as the same identity.
    assert kafka_python_config(config) == {
        "bootstrap_servers": ["k1:9093", "k2:9093"],
        "ssl_cafile": "/etc/ca.pem",
        "security_protocol": "SASL_SSL",
        "ssl_check_hostname": False,
        "client_id": "ops",
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": "alice",
        "sasl_plain_password": "secret",
    }
    assert client_config(None, {"bootstrap.servers": "from-file:9092"})["bootstrap.servers"] == "from-file:9092"


@pytest.mark.parametrize(
    ("props", "message"),
    [
        ({}, "no bootstrap server"),
        ({"bootstrap.servers": "k:1", "ssl.truststore.location": "/t.jks"}, "JKS truststore"),
        ({"bootstrap.servers": "k:1", "ssl.keystore.location": "/k.p12"}, "cannot read Java keystores"),
        ({"bootstrap.servers": "k:1", "ssl.truststore.certificates": "-----BEGIN"}, "inline PEM"),
        ({"bootstrap.servers": "k:1", "sasl.jaas.config": f"{SCRAM} required username=a password=b;"},
         "set sasl.mechanism=SCRAM-SHA-256"),
        ({"bootstrap.servers": "k:1", "sasl.mechanism": "PLAIN",
          "sasl.jaas.config": f"{SCRAM} required username=a password=b;"}, "does not match"),
    ],
)
def test_client_config_refusals(props: dict[str, str], message: str) -> None:
    with pytest.raises(CommandConfigError, match=message):
        client_config(None, props)


def test_durations() -> None:
    assert [parse_duration_ms(t) for t in ("0", "0s", "90s", "15m", "1h", "1h30m", "500ms", "2d", "1.5s")] == [
        0, 0, 90_000, 900_000, 3_600_000, 5_400_000, 500, 172_800_000, 1500,
    ]
    for bad in ("", "5", "5x", "m5", "1h 2", "-1s"):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration_ms(bad)
    assert [format_duration(ms) for ms in (None, -1, 450, 45_000, 125_000, 3_723_000, 90_061_000)] == [
        "-", "-", "450ms", "45s", "2m05s", "1h02m03s", "1d01h01m",
    ]


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (AuthorizationError("TRANSACTIONAL_ID_AUTHORIZATION_FAILED"), ExitCode.AUTHORIZATION),
        (BrokerUnavailableError("no broker"), ExitCode.UNREACHABLE),
        (RetriableError("CONCURRENT_TRANSACTIONS"), ExitCode.UNREACHABLE),
        (UnsupportedBrokerError("no DescribeTransactions"), ExitCode.UNSUPPORTED),
        (HeuristicOutcomeError("aborted", transactional_id="t", state=None, outcome="aborted"), ExitCode.HEURISTIC),
        (IndefiniteOutcomeError("no answer"), ExitCode.INDEFINITE),
        (InvalidPreparedStateError("malformed"), ExitCode.USAGE),
        (CommandConfigError("line 3"), ExitCode.USAGE),
        (FatalError("UNKNOWN_SERVER_ERROR"), ExitCode.FAILURE),
        (CliFailure("unknown transactional id", ExitCode.NOT_FOUND), ExitCode.NOT_FOUND),
        (RuntimeError("boom"), ExitCode.FAILURE),
    ],
)
def test_one_place_maps_errors_to_exit_codes(exc: BaseException, code: ExitCode) -> None:
    mapped, message = classify(exc)
    assert mapped is code
    assert "\n" not in message and message


def test_sqlalchemy_errors_are_database_errors() -> None:
    import sqlalchemy as sa

    mapped, message = classify(sa.exc.OperationalError("SELECT 1", {}, Exception("connection refused\nline 2")))
    assert mapped is ExitCode.DATABASE
    assert message == "database error: OperationalError: connection refused line 2"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("security.protocol=SSL\nno separator\n", "line 2: expected 'key=value'"),
        ("security.protocol=SSL\nssl.truststore.location=/x.jks\n", "export the CA certificate to PEM"),
        ("ssl.protocol=TLSv1.3\n", "'ssl.protocol' cannot be mapped"),
    ],
)
def test_bad_command_config_is_a_usage_error(
    tmp_path: Path, run_kafka2pc: Callable[..., Any], text: str, expected: str
) -> None:
    path = write(tmp_path, text)
    run = run_kafka2pc("list", "--bootstrap-server", "127.0.0.1:1", "--command-config", str(path))
    assert run.returncode == ExitCode.USAGE, run
    assert expected in run.stderr and str(path) in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr


def test_documented_schema_is_strict(documented_shape: Callable[[Any, str], None]) -> None:
    import jsonschema

    txn = {
        "transactional_id": "t", "state": "Ongoing", "producer_id": 1, "producer_epoch": 0, "coordinator_id": 1,
        "timeout_ms": 60000, "start_time_ms": 1, "open_for_ms": 5, "held_back": 2,
        "partitions": [{"topic": "a", "partition": 0, "last_stable_offset": 3, "high_watermark": 5, "held_back": 2}],
    }
    documented_shape({"version": 1, "transactions": [txn]}, "list")
    for broken in (
        {"version": 2, "transactions": [txn]},
        {"version": 1, "transactions": [{**txn, "open_for_ms": -1}]},
        {"version": 1, "transactions": [{**txn, "renamed": 1}]},
        {"version": 1, "transactions": [{k: v for k, v in txn.items() if k != "held_back"}]},
    ):
        with pytest.raises(jsonschema.ValidationError):
            documented_shape(broken, "list")
