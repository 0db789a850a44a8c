"""pytest fixtures backed by real services.

Enable with ``pytest_plugins = ["kafka2pc.testing.pytest_plugin"]``.

- ``kafka_bootstrap`` (session): bootstrap servers of a real broker —
  ``$KAFKA_BOOTSTRAP_SERVERS`` if set, else a local broker started (or reused)
  with :class:`kafka2pc.testing.broker.LocalKafka`.
- ``local_kafka`` (session): that :class:`LocalKafka`, or ``None`` when the
  broker came from ``$KAFKA_BOOTSTRAP_SERVERS``.
- ``topic_factory``: ``topic_factory(partitions=1) -> name`` creates a fresh topic.
- ``pg_url`` (session) / ``pg_engine``: a fresh PostgreSQL database.
- ``sqlite_url`` / ``sqlite_engine``: a SQLite file in ``tmp_path``.

Under pytest-xdist each worker process (``gw0``, ``gw1``, ...) runs its own brokers in its own
port block (:func:`kafka2pc.testing.broker.worker_port_base`), so ``pytest -n 2`` needs no more set-up.

When a service cannot be started the fixture calls ``pytest.fail``: a test
never silently skips because Kafka or PostgreSQL is missing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from kafka2pc.testing._kafka import create_topic

if TYPE_CHECKING:
    import sqlalchemy as sa

    from kafka2pc.testing.broker import LocalKafka


def pytest_configure(config: pytest.Config) -> None:
    """Move a pytest-xdist worker's brokers to a port block of its own (``$KAFKA2PC_PORT_BASE``)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        from kafka2pc.testing.broker import port_base, worker_port_base

        os.environ["KAFKA2PC_PORT_BASE"] = str(worker_port_base(port_base(), int(worker[2:])))


@pytest.fixture(scope="session")
def local_kafka() -> Iterator[LocalKafka | None]:
    """The local broker this session started or reused (``None`` with ``$KAFKA_BOOTSTRAP_SERVERS``)."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield None
        return
    from kafka2pc.testing.broker import BrokerError, LocalKafka

    try:
        kafka = LocalKafka.up()
    except BrokerError as exc:
        pytest.fail(f"could not start a local Kafka broker: {exc}", pytrace=False)
    yield kafka


@pytest.fixture(scope="session")
def kafka_bootstrap(local_kafka: LocalKafka | None) -> str:
    """Bootstrap servers of a real, running Kafka broker."""
    if local_kafka is None:
        return os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    return local_kafka.bootstrap_servers


@pytest.fixture
def topic_factory(kafka_bootstrap: str) -> Callable[..., str]:
    """Create fresh topics: ``topic_factory(partitions=3)`` returns the new topic's name."""

    def make(partitions: int = 1, **kwargs: Any) -> str:
        return create_topic(kafka_bootstrap, partitions=partitions, **kwargs)

    return make


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """URL of a fresh PostgreSQL database, dropped at the end of the session."""
    from kafka2pc.testing.postgres import PostgresUnavailable, fresh_database

    try:
        with fresh_database() as url:
            yield url
    except PostgresUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[sa.Engine]:
    """A SQLAlchemy engine on the session's PostgreSQL database."""
    import sqlalchemy as sa

    engine = sa.create_engine(pg_url)
    yield engine
    engine.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Any) -> str:
    """URL of a SQLite database file in the test's temporary directory."""
    return f"sqlite:///{tmp_path / 'test.db'}"


@pytest.fixture
def sqlite_engine(sqlite_url: str) -> Iterator[sa.Engine]:
    """A SQLAlchemy engine on a fresh SQLite file."""
    import sqlalchemy as sa

    engine = sa.create_engine(sqlite_url)
    yield engine
    engine.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Each test using it runs once on PostgreSQL and once on SQLite."""
    if request.param == "postgresql":
        return str(request.getfixturevalue("pg_url"))
    return str(request.getfixturevalue("sqlite_url"))
