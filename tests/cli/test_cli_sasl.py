"""``--command-config`` against a real SASL/PLAIN broker with an authorizer.

A dedicated single-node 4.x broker (started for this module, wiped at its end)
has a SASL_PLAINTEXT listener with two users: ``admin`` (super user) and
``alice`` (no ACLs).  It checks that a Java-style properties file with a
``sasl.jaas.config`` line connects, that a principal without ACLs gets the
authorization exit code, and that wrong credentials do too (not "unreachable").
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka2pc.cli._errors import ExitCode

from kafka2pc.testing.broker import BrokerError, LocalKafka, port_base

PLAIN = "org.apache.kafka.common.security.plain.PlainLoginModule"


def free_base_port() -> int:
    """Three consecutive free ports (broker, controller, SASL listener)."""
    for base in range(port_base() + 592, port_base() + 992, 10):
        taken = False
        for port in (base, base + 1, base + 2):
            with socket.socket() as sock:
                taken = taken or sock.connect_ex(("127.0.0.1", port)) == 0
        if not taken:
            return base
    pytest.fail("no free ports for the SASL broker")


@pytest.fixture(scope="module")
def sasl_bootstrap() -> Iterator[str]:
    base = free_base_port()
    settings = {
        "listeners": f"PLAINTEXT://127.0.0.1:{base},SASL_PLAINTEXT://127.0.0.1:{base + 2},"
        f"CONTROLLER://127.0.0.1:{base + 1}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{base},SASL_PLAINTEXT://127.0.0.1:{base + 2}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT",
        "sasl.enabled.mechanisms": "PLAIN",
        "listener.name.sasl_plaintext.plain.sasl.jaas.config":
            f'{PLAIN} required user_admin="admin-secret" user_alice="alice-secret";',
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        # The PLAINTEXT listener (readiness checks, the controller) is ANONYMOUS: make it a super user.
        "super.users": "User:ANONYMOUS;User:admin",
        "allow.everyone.if.no.acl.found": "false",
    }
    kafka = LocalKafka(base_port=base, name=f"cli-sasl-{base}", extra_settings=settings)
    try:
        kafka.start()
    except BrokerError as exc:
        kafka.wipe()
        pytest.fail(f"could not start the SASL broker: {exc}", pytrace=False)
    try:
        yield f"127.0.0.1:{base + 2}"
    finally:
        kafka.wipe()


def properties(tmp_path: Path, user: str, password: str, *, mechanism: bool) -> str:
    path = tmp_path / f"{user}.properties"
    path.write_text(
        "# as for kafka-transactions.sh --command-config\n"
        "security.protocol=SASL_PLAINTEXT\n"
        + ("sasl.mechanism=PLAIN\n" if mechanism else "")
        + f'sasl.jaas.config={PLAIN} required \\\n    username="{user}" password="{password}";\n'
    )
    return str(path)


def test_command_config_sasl_plain(
    sasl_bootstrap: str, tmp_path: Path, run_kafka2pc: Callable[..., Any]
) -> None:
    def run(config: str, *args: str) -> Any:
        # --timeout bounds each Kafka call: the first transactional call on this fresh broker waits for
        # __transaction_state to be created (tens of seconds on a loaded machine).
        return run_kafka2pc("--bootstrap-server", sasl_bootstrap, "--command-config", config, "--timeout", "30", *args)

    admin = properties(tmp_path, "admin", "admin-secret", mechanism=False)  # PLAIN inferred from the module
    listed = run(admin, "list", "-o", "json")
    assert listed.returncode == 0 and listed.json() == {"version": 1, "transactions": []}, listed
    unknown = run(admin, "describe", "some-id")
    assert unknown.returncode == ExitCode.NOT_FOUND, str(unknown)  # authenticated and authorized: the coordinator answered

    alice = properties(tmp_path, "alice", "alice-secret", mechanism=True)
    denied = run(alice, "describe", "some-id")
    assert denied.returncode == ExitCode.AUTHORIZATION, denied
    assert "TRANSACTIONAL_ID_AUTHORIZATION_FAILED" in denied.stderr and "Traceback" not in denied.stderr

    wrong = properties(tmp_path, "alice", "wrong-secret", mechanism=True)
    failed = run(wrong, "list")
    assert failed.returncode == ExitCode.AUTHORIZATION, failed
    assert "Authentication failed" in failed.stderr and "wrong-secret" not in failed.stderr

    no_credentials = run_kafka2pc("--bootstrap-server", sasl_bootstrap, "--timeout", "3", "list")
    assert no_credentials.returncode == ExitCode.UNREACHABLE, no_credentials  # PLAINTEXT client, SASL listener
