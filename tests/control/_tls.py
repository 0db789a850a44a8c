"""A throwaway PKI and a one-node broker with TLS listeners and an ACL authorizer.

Imported by ``test_tls.py`` as ``_tls`` (pytest puts ``tests/control`` on
``sys.path``).  Certificates are made with ``openssl`` into a temporary
directory: a CA, the broker's certificate (SAN ``IP:127.0.0.1``,
``DNS:localhost``) and one client certificate per principal (subject ``CN=<name>``, which the
broker maps to the principal ``User:<name>``).
The broker reads PEM key and trust stores (Kafka 2.7+, KIP-651).

Listeners:

* ``PLAINTEXT`` (``base``): readiness checks, inter-broker; its ANONYMOUS
  principal is a super user;
* ``CONTROLLER`` (``base + 1``);
* ``SSL`` (``base + 2``): server-authenticated TLS; clients are ANONYMOUS
  there too (no client certificate asked);
* ``MTLS`` (``base + 3``): mutual TLS, a client certificate is required and
  its ``CN`` becomes the principal ``User:<CN>``.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kafka2pc.testing.broker import LocalKafka

KEY_PASSWORD = "broker-key-secret"


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")


@dataclass(frozen=True)
class Pki:
    """Paths of the CA, the broker's PEM key store, and each client's certificate and key."""

    directory: Path
    ca: Path
    broker_keystore: Path

    def certificate(self, name: str) -> Path:
        return self.directory / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.directory / f"{name}.key"


def make_pki(directory: Path, clients: list[str]) -> Pki:
    """A CA, a broker certificate for 127.0.0.1 and a client certificate for each name."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "2", "-subj", "/CN=kafka2pc-test-ca", cwd=directory)
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, extension in [("broker", "san.ext"), *((client, None) for client in clients)]:
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=directory)
        sign = ["x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2"]
        if extension:
            sign += ["-extfile", extension]
        _openssl(*sign, cwd=directory)
    # The broker's PEM key store: an encrypted PKCS#8 key followed by its certificate chain.
    _openssl("pkcs8", "-topk8", "-in", "broker.key", "-out", "broker.p8", "-v1", "PBE-SHA1-3DES",
             "-passout", f"pass:{KEY_PASSWORD}", cwd=directory)
    keystore = directory / "broker-keystore.pem"
    keystore.write_text(
        (directory / "broker.p8").read_text()
        + (directory / "broker.crt").read_text()
        + (directory / "ca.crt").read_text()
    )
    return Pki(directory, directory / "ca.crt", keystore)


def tls_broker(pki: Pki, base: int, *, super_users: list[str]) -> LocalKafka:
    """A (not yet started) one-node broker with SSL and mutual-TLS listeners and an ACL authorizer."""
    settings = {
        "listeners": f"PLAINTEXT://127.0.0.1:{base},CONTROLLER://127.0.0.1:{base + 1},"
        f"SSL://127.0.0.1:{base + 2},MTLS://127.0.0.1:{base + 3}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{base},SSL://127.0.0.1:{base + 2},"
        f"MTLS://127.0.0.1:{base + 3}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SSL:SSL,MTLS:SSL",
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(pki.broker_keystore),
        "ssl.key.password": KEY_PASSWORD,
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(pki.ca),
        "ssl.client.auth": "none",
        "listener.name.mtls.ssl.client.auth": "required",
        "ssl.principal.mapping.rules": "RULE:^CN=([^,]+)$/$1/,DEFAULT",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": ";".join(["User:ANONYMOUS", *(f"User:{user}" for user in super_users)]),
        "allow.everyone.if.no.acl.found": "false",
    }
    return LocalKafka(base_port=base, name=f"control-tls-{base}-{os.getpid()}", extra_settings=settings)
