"""docker-compose.yml and the local broker share one set of 2PC-relevant settings."""

from __future__ import annotations

import re
from pathlib import Path

from kafka2pc.testing._settings import DEFAULT_KAFKA_VERSION, TRANSACTION_SETTINGS

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def _compose_kafka_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for match in re.finditer(r'^\s+(KAFKA_[A-Z0-9_]+):\s*"([^"]*)"', COMPOSE.read_text(), re.MULTILINE):
        env[match.group(1)] = match.group(2)
    return env


def test_compose_broker_settings_match_local_broker() -> None:
    env = _compose_kafka_env()
    expected = {"KAFKA_" + name.upper().replace(".", "_"): value for name, value in TRANSACTION_SETTINGS.items()}
    assert {k: env.get(k) for k in expected} == expected


def test_compose_uses_the_same_kafka_version() -> None:
    assert f"image: apache/kafka:{DEFAULT_KAFKA_VERSION}" in COMPOSE.read_text()
