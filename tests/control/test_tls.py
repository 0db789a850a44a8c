"""TLS, mutual TLS and ACLs against a real broker.

One private one-node broker (see ``_tls.py``) serves a server-authenticated
TLS listener and a mutual-TLS listener, with an ACL authorizer.  The data
plane (confluent-kafka) and the control plane (kafka-python) are given the
*same* confluent-kafka settings (``security.protocol``, ``ssl.ca.location``,
``ssl.certificate.location``, ``ssl.key.location``); a prepared transaction is
committed through each.  Principals missing an ACL get an
:class:`AuthorizationError` that names the missing operation and resource,
from the producer, from :class:`TransactionAdmin` and from the CLI.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _tls import Pki, make_pki, tls_broker
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)
from harness.ports import OTHER_RANGES, is_closed, started

from kafka2pc import (
    AuthorizationError,
    BrokerUnavailableError,
    TransactionAdmin,
    TransactionOutcome,
    TwoPhaseCommitProducer,
)
from kafka2pc._control import ControlPlane
from kafka2pc.testing import create_topic, drain
from kafka2pc.testing.broker import LocalKafka, port_base

PREFIX = "tls-"
FIRST, END = OTHER_RANGES["control/test_tls broker, 4 ports (searches)"]
APP, NO_TXN_WRITE, NO_CLUSTER = "app", "no-txn-write", "no-cluster"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), [APP, NO_TXN_WRITE, NO_CLUSTER])


@pytest.fixture(scope="module")
def tls_kafka(pki: Pki) -> Iterator[LocalKafka]:
    base = next(
        (b for b in range(port_base() + FIRST, port_base() + END, 10) if all(is_closed(b + i) for i in range(4))),
        None,
    )
    if base is None:
        pytest.fail("no free ports for the TLS broker")
    with started(tls_broker(pki, base, super_users=[]), "the TLS broker") as kafka:
        grant_acls(kafka.bootstrap_servers)
        yield kafka


def _allow(principal: str, resource: ResourceType, name: str, pattern: ResourcePatternType,
           operation: AclOperation) -> AclBinding:
    return AclBinding(resource, name, pattern, f"User:{principal}", "*", operation, AclPermissionType.ALLOW)


def grant_acls(plaintext_bootstrap: str) -> None:
    """``app`` may do everything kafka2pc needs; the two others miss one grant each."""
    bindings = []
    for principal in (APP, NO_TXN_WRITE, NO_CLUSTER):
        for operation in (AclOperation.WRITE, AclOperation.READ, AclOperation.DESCRIBE):
            bindings.append(_allow(principal, ResourceType.TOPIC, PREFIX, ResourcePatternType.PREFIXED, operation))
        bindings.append(_allow(principal, ResourceType.GROUP, "kafka2pc-", ResourcePatternType.PREFIXED,
                               AclOperation.READ))
        bindings.append(_allow(principal, ResourceType.TRANSACTIONAL_ID, PREFIX, ResourcePatternType.PREFIXED,
                               AclOperation.DESCRIBE))
        if principal != NO_TXN_WRITE:
            bindings.append(_allow(principal, ResourceType.TRANSACTIONAL_ID, PREFIX,
                                   ResourcePatternType.PREFIXED, AclOperation.WRITE))
        if principal != NO_CLUSTER:
            for operation in (AclOperation.DESCRIBE, AclOperation.DESCRIBE_CONFIGS):
                bindings.append(_allow(principal, ResourceType.BROKER, "kafka-cluster",
                                       ResourcePatternType.LITERAL, operation))
    admin = AdminClient({"bootstrap.servers": plaintext_bootstrap})
    for future in admin.create_acls(bindings).values():
        future.result(30)
    # ACLs reach the broker's authorizer through the metadata log; DescribeAcls reads that authorizer.
    every = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, None, None, AclOperation.ANY,
                             AclPermissionType.ANY)
    wanted = {_acl_key(b) for b in bindings}
    deadline = time.monotonic() + 30
    while not wanted <= {_acl_key(b) for b in admin.describe_acls(every).result(30)}:
        assert time.monotonic() < deadline, "the broker's authorizer did not have the ACLs after 30 s"
        time.sleep(0.05)


def _acl_key(binding: AclBinding) -> tuple[object, ...]:
    return (binding.restype, binding.name, binding.resource_pattern_type, binding.principal, binding.host,
            binding.operation, binding.permission_type)


def ssl_config(kafka: LocalKafka, pki: Pki) -> dict[str, Any]:
    """Server-authenticated TLS: trust the test CA, no client certificate."""
    return {
        "bootstrap.servers": f"127.0.0.1:{kafka.base_port + 2}",
        "security.protocol": "SSL",
        "ssl.ca.location": str(pki.ca),
    }


def mtls_config(kafka: LocalKafka, pki: Pki, principal: str) -> dict[str, Any]:
    """Mutual TLS as ``principal`` (its certificate's CN)."""
    return {
        "bootstrap.servers": f"127.0.0.1:{kafka.base_port + 3}",
        "security.protocol": "SSL",
        "ssl.ca.location": str(pki.ca),
        "ssl.certificate.location": str(pki.certificate(principal)),
        "ssl.key.location": str(pki.key(principal)),
    }


def commit_through_recovery(kafka: LocalKafka, config: dict[str, Any]) -> None:
    """Prepare a transaction with the producer, then commit it from a TransactionAdmin (same settings)."""
    topic = f"{PREFIX}{uuid.uuid4().hex[:8]}"
    create_topic(kafka.bootstrap_servers, topic)
    txid = f"{PREFIX}tx-{uuid.uuid4().hex[:8]}"
    producer = TwoPhaseCommitProducer({**config, "transactional.id": txid, "transaction.timeout.ms": 60_000})
    try:
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.produce(topic, b"over-tls")
        state = producer.prepare_transaction(30)
        with TransactionAdmin(config, timeout_s=30) as admin:
            info = admin.describe_transaction(txid)
            assert info is not None and info.state == "Ongoing"
            settlement = admin.complete_transaction(txid, state)
            assert settlement.outcome is TransactionOutcome.COMMITTED
            assert admin.transaction_outcome(txid, state) is TransactionOutcome.COMMITTED  # read_committed probe
    finally:
        producer.close(5)
    assert [r.value for r in drain(kafka.bootstrap_servers, topic, "read_committed")] == [b"over-tls"]


def test_server_authenticated_tls(tls_kafka: LocalKafka, pki: Pki) -> None:
    commit_through_recovery(tls_kafka, ssl_config(tls_kafka, pki))


def test_mutual_tls(tls_kafka: LocalKafka, pki: Pki) -> None:
    commit_through_recovery(tls_kafka, mtls_config(tls_kafka, pki, APP))


def test_untrusted_server_certificate_is_a_clear_tls_error(tls_kafka: LocalKafka, pki: Pki) -> None:
    config = ssl_config(tls_kafka, pki)
    del config["ssl.ca.location"]  # the system store does not know the test CA
    config["ssl.ca.location"] = "probe"
    with TransactionAdmin(config, timeout_s=5) as admin:
        with pytest.raises(BrokerUnavailableError):
            admin.describe_transaction(f"{PREFIX}x")
        diagnosis = admin.diagnose_connection(timeout=5)
    assert isinstance(diagnosis, BrokerUnavailableError) and "TLS handshake failed" in str(diagnosis), diagnosis


def test_mutual_tls_without_a_client_certificate_is_refused(tls_kafka: LocalKafka, pki: Pki, tmp_path: Path) -> None:
    config = mtls_config(tls_kafka, pki, APP)
    del config["ssl.certificate.location"], config["ssl.key.location"]
    properties = tmp_path / "no-cert.properties"
    properties.write_text(f"security.protocol=SSL\nssl.ca.location={pki.ca}\n")
    cli = subprocess.run([_console_script(), "--bootstrap-server", config["bootstrap.servers"], "--command-config",
                          str(properties), "--timeout", "3", "list"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 5, cli  # ExitCode.UNREACHABLE, with the reason
    assert "TLS handshake failed" in cli.stderr and "ssl.certificate.location" in cli.stderr, cli
    with TransactionAdmin(config, timeout_s=5) as admin:
        with pytest.raises(BrokerUnavailableError):
            admin.list_transactions()
        diagnosis = admin.diagnose_connection(timeout=5)
    assert isinstance(diagnosis, BrokerUnavailableError), diagnosis
    assert "TLS handshake failed" in str(diagnosis) and "ssl.certificate.location" in str(diagnosis), diagnosis


# -- ACLs -------------------------------------------------------------------------


def test_missing_write_on_the_transactional_id(tls_kafka: LocalKafka, pki: Pki) -> None:
    config = mtls_config(tls_kafka, pki, NO_TXN_WRITE)
    txid = f"{PREFIX}denied-{uuid.uuid4().hex[:8]}"
    producer = TwoPhaseCommitProducer({**config, "transactional.id": txid, "transaction.timeout.ms": 60_000})
    try:
        with pytest.raises(AuthorizationError) as from_producer:
            producer.init_transactions(20)
    finally:
        producer.close(5)
    print(f"\n  producer: {from_producer.value}")
    assert from_producer.value.error_name == "TRANSACTIONAL_ID_AUTHORIZATION_FAILED", from_producer.value
    assert "WRITE" in str(from_producer.value) and "TransactionalId" in str(from_producer.value)

    with TransactionAdmin(config, timeout_s=20) as admin, pytest.raises(AuthorizationError) as from_admin:
        admin.control_plane.fence(txid)
    message = str(from_admin.value)
    print(f"  TransactionAdmin: {message}")
    assert from_admin.value.error_name == "TRANSACTIONAL_ID_AUTHORIZATION_FAILED", message
    assert f"WRITE on TransactionalId {txid!r}" in message, message


def test_missing_cluster_acls(tls_kafka: LocalKafka, pki: Pki) -> None:
    config = mtls_config(tls_kafka, pki, NO_CLUSTER)
    with ControlPlane(config, timeout_s=20) as control, pytest.raises(AuthorizationError) as from_control:
        control.broker_config(["transaction.max.timeout.ms"])
    message = str(from_control.value)
    print(f"\n  control plane: {message}")
    assert "DESCRIBE_CONFIGS on the Cluster" in message, message

    txid = f"{PREFIX}nocluster-{uuid.uuid4().hex[:8]}"
    producer = TwoPhaseCommitProducer({**config, "transactional.id": txid})  # picks transaction.timeout.ms itself
    try:
        with pytest.raises(AuthorizationError) as from_producer:
            producer.init_transactions(20)
    finally:
        producer.close(5)
    print(f"  producer: {from_producer.value}")
    assert "Cluster" in str(from_producer.value), from_producer.value

    # The operator's calls need no cluster ACL (docs/security.md): listing and describing still work.
    with TransactionAdmin(config, timeout_s=20) as admin:
        assert admin.describe_transaction(txid) is None
        assert isinstance(admin.list_transactions(), list)


def _console_script() -> str:
    beside = Path(sys.executable).parent / "kafka2pc"
    assert beside.exists(), "the kafka2pc console script is not installed (pip install -e .)"
    return str(beside)


def test_cli_names_the_missing_acl(tls_kafka: LocalKafka, pki: Pki, tmp_path: Path) -> None:
    config = mtls_config(tls_kafka, pki, NO_TXN_WRITE)
    properties = tmp_path / "client.properties"
    properties.write_text("".join(f"{k}={v}\n" for k, v in config.items() if k != "bootstrap.servers"))
    txid = f"{PREFIX}cli-{uuid.uuid4().hex[:8]}"
    # Make the id known to the coordinator (as a super user), so force-terminate gets as far as InitProducerId.
    registrar = TwoPhaseCommitProducer({"bootstrap.servers": tls_kafka.bootstrap_servers, "transactional.id": txid,
                                        "transaction.timeout.ms": 60_000})
    try:
        registrar.init_transactions(30)
    finally:
        registrar.close(5)
    base = [_console_script(), "--bootstrap-server", config["bootstrap.servers"], "--command-config",
            str(properties), "--timeout", "60"]
    described = subprocess.run([*base, "describe", txid], capture_output=True, text=True, timeout=60)
    assert described.returncode == 0, described  # DESCRIBE is granted: TLS and the principal work
    denied = subprocess.run([*base, "force-terminate", "--yes", txid], capture_output=True, text=True, timeout=60)
    print(f"\n  CLI: {denied.stderr.strip()}")
    assert denied.returncode == 6, denied  # ExitCode.AUTHORIZATION
    assert f"WRITE on TransactionalId '{txid}'" in denied.stderr and "Traceback" not in denied.stderr, denied
