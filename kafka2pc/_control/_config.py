"""One client configuration, two dialects: librdkafka's and kafka-python's.

Users configure kafka2pc once, in confluent-kafka's (librdkafka's) dialect.
The data plane (the producer, the outcome probe's consumer, the CLI's
diagnosis) needs the *connection* part of that dict as librdkafka settings;
the control plane (kafka-python) needs the same connection and identity in
its own names.  :func:`connection_settings` derives both, in one place, so
that every client kafka2pc opens reaches the same cluster with the same
credentials and the same TLS trust.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kafka2pc._exceptions import UsageError

__all__ = [
    "ConnectionSettings",
    "connection_settings",
    "kafka_python_config",
    "librdkafka_connection_config",
]

log = logging.getLogger(__name__)

_SECURITY_PREFIXES = ("security.", "sasl.", "ssl.", "enable.ssl.")
_SECURITY_EXACT = frozenset({"oauth_cb", "ssl_key"})
_SECURITY_PROTOCOLS = frozenset({"PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"})
_SASL_MECHANISMS = frozenset({"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI"})
_BOOTSTRAP_KEYS = ("bootstrap.servers", "metadata.broker.list")
# Non-security librdkafka settings a helper client needs to reach the cluster.
_CONNECTION_KEYS = frozenset({*_BOOTSTRAP_KEYS, "client.id", "client.dns.lookup", "broker.address.family"})
# confluent key -> kafka-python key, values copied as strings.
_DIRECT_KEYS = {
    "client.id": "client_id",
    "sasl.username": "sasl_plain_username",
    "sasl.password": "sasl_plain_password",
    "sasl.kerberos.service.name": "sasl_kerberos_service_name",
    "ssl.ca.location": "ssl_cafile",
    "ssl.certificate.location": "ssl_certfile",
    "ssl.key.location": "ssl_keyfile",
    "ssl.key.password": "ssl_password",
    "ssl.crl.location": "ssl_crlfile",
}

#: librdkafka's reconnect backoff settings -> kafka-python's (milliseconds, both).
_BACKOFF_KEYS = {
    "reconnect.backoff.ms": "reconnect_backoff_ms",
    "reconnect.backoff.max.ms": "reconnect_backoff_max_ms",
}


def is_security_key(key: str) -> bool:
    """Is ``key`` a librdkafka security setting (``security.*``, ``sasl.*``, ``ssl.*``...)?"""
    return key.startswith(_SECURITY_PREFIXES) or key in _SECURITY_EXACT


@dataclass(frozen=True)
class ConnectionSettings:
    """The connection part of a confluent-kafka config, in both client dialects.

    ``librdkafka``: the settings a helper confluent-kafka client (consumer,
    admin client) needs to reach the cluster as the producer does.
    ``kafka_python``: the same connection as ``KafkaAdminClient`` keyword
    arguments (see :func:`kafka_python_config`).
    """

    librdkafka: Mapping[str, Any] = field(default_factory=dict)
    kafka_python: Mapping[str, Any] = field(default_factory=dict)

    @property
    def secured(self) -> bool:
        """True when the connection uses TLS and/or SASL (not ``PLAINTEXT``)."""
        return str(self.kafka_python.get("security_protocol", "PLAINTEXT")) != "PLAINTEXT"


def connection_settings(confluent_config: Mapping[str, Any]) -> ConnectionSettings:
    """Both dialects of the connection settings in ``confluent_config``.

    Raises :class:`UsageError` naming the key when a setting cannot be
    honoured by both clients (see :func:`kafka_python_config`).

    >>> s = connection_settings({"bootstrap.servers": "k:9093", "security.protocol": "SSL",
    ...                          "ssl.ca.location": "/ca.pem", "acks": "all"})
    >>> s.librdkafka
    {'bootstrap.servers': 'k:9093', 'security.protocol': 'SSL', 'ssl.ca.location': '/ca.pem'}
    >>> s.kafka_python
    {'bootstrap_servers': ['k:9093'], 'security_protocol': 'SSL', 'ssl_cafile': '/ca.pem'}
    """
    return ConnectionSettings(
        librdkafka=librdkafka_connection_config(confluent_config),
        kafka_python=kafka_python_config(confluent_config),
    )


def librdkafka_connection_config(confluent_config: Mapping[str, Any]) -> dict[str, Any]:
    """The librdkafka settings a helper client needs to reach the cluster (no producer keys)."""
    return {k: v for k, v in confluent_config.items() if k in _CONNECTION_KEYS or is_security_key(k)}


def kafka_python_config(confluent_config: Mapping[str, Any]) -> dict[str, Any]:
    """Derive kafka-python connection settings from a confluent-kafka config.

    Only connection settings are mapped.  Producer/consumer-only keys
    (``transactional.id``, ``acks``, ``linger.ms``...) are ignored (logged at
    debug level).  A *security* key this function cannot map raises
    :class:`UsageError` naming it: connecting with weaker or different
    security than the user asked for must never happen silently.

    >>> kafka_python_config({"bootstrap.servers": "a:9092,b:9092"})
    {'bootstrap_servers': ['a:9092', 'b:9092']}
    """
    result: dict[str, Any] = {}
    bootstrap = confluent_config.get("bootstrap.servers") or confluent_config.get("metadata.broker.list")
    if not bootstrap or not isinstance(bootstrap, str):
        raise UsageError("config needs 'bootstrap.servers' (a comma-separated host:port list)")
    servers = [s.strip() for s in bootstrap.split(",") if s.strip()]
    if not servers:
        raise UsageError("'bootstrap.servers' is empty")
    result["bootstrap_servers"] = servers

    for key, value in confluent_config.items():
        if key in _BOOTSTRAP_KEYS:
            continue
        if key in _DIRECT_KEYS:
            if value is not None:
                result[_DIRECT_KEYS[key]] = str(value)
        elif key == "security.protocol":
            protocol = str(value).upper()
            if protocol not in _SECURITY_PROTOCOLS:
                raise UsageError(f"unsupported security.protocol {value!r}")
            result["security_protocol"] = protocol
        elif key in ("sasl.mechanism", "sasl.mechanisms"):
            mechanism = str(value).upper()
            if mechanism not in _SASL_MECHANISMS:
                raise UsageError(
                    f"{key}={value!r} cannot be used by kafka2pc's control plane "
                    f"(supported: {', '.join(sorted(_SASL_MECHANISMS))})"
                )
            result["sasl_mechanism"] = mechanism
        elif key in _BACKOFF_KEYS:
            # Both clients back off alike: kafka-python's default ceiling is 30 s (librdkafka's 10 s), and
            # a control plane bootstrapping while a broker restarts would otherwise sleep past its return.
            try:
                result[_BACKOFF_KEYS[key]] = int(value)
            except (TypeError, ValueError):
                raise UsageError(f"{key} must be a number of milliseconds, not {value!r}") from None
        elif key == "ssl.endpoint.identification.algorithm":
            algorithm = str(value).lower()
            if algorithm not in ("https", "none"):
                raise UsageError(f"unsupported ssl.endpoint.identification.algorithm {value!r}")
            result["ssl_check_hostname"] = algorithm == "https"
        elif is_security_key(key):
            raise UsageError(
                f"security setting {key!r} cannot be mapped to the control plane's "
                "kafka-python connection; use the *.location file settings instead"
            )
        else:
            log.debug("control plane ignores non-connection setting %r", key)

    if result.get("ssl_cafile") == "probe":  # librdkafka: use the system CA store
        del result["ssl_cafile"]
    if "sasl_mechanism" in result and not result.get("security_protocol", "").startswith("SASL"):
        raise UsageError("sasl.mechanism is set but security.protocol is not SASL_PLAINTEXT/SASL_SSL")
    return result
