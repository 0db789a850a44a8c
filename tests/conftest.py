"""Test configuration: real Kafka, PostgreSQL and SQLite through kafka2pc.testing."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kafka2pc.testing.broker import BrokerError, LocalKafka

pytest_plugins = ["kafka2pc.testing.pytest_plugin"]

LEGACY_KAFKA_VERSION = os.environ.get("KAFKA_LEGACY_VERSION", "3.9.2")


@pytest.fixture(scope="session")
def legacy_kafka() -> Iterator[LocalKafka]:
    """A broker of the older 3.9.x line (no 2PC support), started on demand."""
    try:
        kafka = LocalKafka.up(version=LEGACY_KAFKA_VERSION)
    except BrokerError as exc:
        pytest.fail(f"could not start Kafka {LEGACY_KAFKA_VERSION}: {exc}", pytrace=False)
    yield kafka
    kafka.stop()


@pytest.fixture(params=["current", "legacy"])
def any_kafka_bootstrap(request: pytest.FixtureRequest) -> str:
    """Runs a test against the newest 4.x broker and against the 3.9.x line."""
    if request.param == "current":
        return str(request.getfixturevalue("kafka_bootstrap"))
    return request.getfixturevalue("legacy_kafka").bootstrap_servers
