"""Unit tests for kafka_python_config: confluent-kafka settings -> kafka-python settings."""

from __future__ import annotations

import logging

import pytest

from kafka2pc._control import kafka_python_config
from kafka2pc._exceptions import UsageError


def test_bootstrap_servers_are_split_and_stripped() -> None:
    assert kafka_python_config({"bootstrap.servers": "a:9092, b:9093,"}) == {
        "bootstrap_servers": ["a:9092", "b:9093"]
    }


def test_missing_bootstrap_servers_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="bootstrap.servers"):
        kafka_python_config({"client.id": "x"})


def test_sasl_ssl_scram_full_mapping() -> None:
    config = {
        "bootstrap.servers": "broker:9094",
        "client.id": "app-1",
        "security.protocol": "sasl_ssl",
        "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": "alice",
        "sasl.password": "s3cret",
        "ssl.ca.location": "/etc/ca.pem",
        "ssl.certificate.location": "/etc/client.pem",
        "ssl.key.location": "/etc/client.key",
        "ssl.key.password": "kp",
        "ssl.endpoint.identification.algorithm": "none",
    }
    assert kafka_python_config(config) == {
        "bootstrap_servers": ["broker:9094"],
        "client_id": "app-1",
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "alice",
        "sasl_plain_password": "s3cret",
        "ssl_cafile": "/etc/ca.pem",
        "ssl_certfile": "/etc/client.pem",
        "ssl_keyfile": "/etc/client.key",
        "ssl_password": "kp",
        "ssl_check_hostname": False,
    }


def test_singular_sasl_mechanism_alias_and_https_hostname_check() -> None:
    result = kafka_python_config(
        {
            "bootstrap.servers": "b:1",
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "plain",
            "ssl.endpoint.identification.algorithm": "https",
        }
    )
    assert result["sasl_mechanism"] == "PLAIN"
    assert result["ssl_check_hostname"] is True


def test_ca_location_probe_means_system_store() -> None:
    result = kafka_python_config(
        {"bootstrap.servers": "b:1", "security.protocol": "SSL", "ssl.ca.location": "probe"}
    )
    assert "ssl_cafile" not in result


def test_producer_only_keys_are_ignored_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="kafka2pc._control"):
        result = kafka_python_config(
            {
                "bootstrap.servers": "b:1",
                "transactional.id": "tx",
                "acks": "all",
                "linger.ms": 5,
                "transaction.timeout.ms": 60000,
            }
        )
    assert result == {"bootstrap_servers": ["b:1"]}
    assert "transactional.id" in caplog.text


@pytest.mark.parametrize(
    "key,value",
    [
        ("ssl.keystore.location", "/etc/ks.p12"),
        ("ssl.certificate.pem", "-----BEGIN CERTIFICATE-----"),
        ("sasl.kerberos.keytab", "/etc/krb5.keytab"),
        ("sasl.oauthbearer.method", "oidc"),
        ("enable.ssl.certificate.verification", False),
        ("ssl.cipher.suites", "ECDHE"),
    ],
)
def test_unmappable_security_key_is_a_usage_error_naming_it(key: str, value: object) -> None:
    with pytest.raises(UsageError, match=key.replace(".", r"\.")):
        kafka_python_config({"bootstrap.servers": "b:1", key: value})


@pytest.mark.parametrize("mechanism", ["OAUTHBEARER", "AWS_MSK_IAM"])
def test_unsupported_sasl_mechanism_is_a_usage_error(mechanism: str) -> None:
    with pytest.raises(UsageError, match=mechanism):
        kafka_python_config(
            {"bootstrap.servers": "b:1", "security.protocol": "SASL_SSL", "sasl.mechanism": mechanism}
        )


def test_unknown_security_protocol_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="security.protocol"):
        kafka_python_config({"bootstrap.servers": "b:1", "security.protocol": "TLS"})


def test_sasl_mechanism_without_sasl_protocol_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="SASL"):
        kafka_python_config({"bootstrap.servers": "b:1", "sasl.mechanism": "PLAIN"})


def test_the_input_mapping_is_not_modified() -> None:
    config = {"bootstrap.servers": "b:1", "ssl.ca.location": "probe", "security.protocol": "SSL"}
    before = dict(config)
    kafka_python_config(config)
    assert config == before


def test_reconnect_backoff_settings_apply_to_the_control_plane_too() -> None:
    """kafka-python backs off up to 30 s by default: a control plane bootstrapping while a broker
    restarts would sleep past its return although the application asked for a short backoff."""
    result = kafka_python_config(
        {"bootstrap.servers": "b:1", "reconnect.backoff.ms": "20", "reconnect.backoff.max.ms": 500}
    )
    assert result == {"bootstrap_servers": ["b:1"], "reconnect_backoff_ms": 20, "reconnect_backoff_max_ms": 500}
    with pytest.raises(UsageError, match="reconnect.backoff.max.ms must be a number of milliseconds"):
        kafka_python_config({"bootstrap.servers": "b:1", "reconnect.backoff.max.ms": "soon"})
