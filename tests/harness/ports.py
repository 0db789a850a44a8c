"""Every listener port the test suite binds inside its block: one registry, so that no two users share a port.

The block is ``[port_base(), port_base() + 2000)`` (``$KAFKA2PC_PORT_BASE``).
The shared brokers of each release line take the slots
:func:`kafka2pc.testing.broker.LocalKafka` gives them (``+92``, ``+192``,
``+1092``, ``+1192``, ``+1300 + 20 * minor``); everything else a test binds
is named here, and ``tests/unit/test_port_registry.py`` checks that no two
ranges overlap.  A private broker (one a test may stop, freeze or kill) is
started with :func:`private_broker` at its module's slot.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kafka2pc.testing.broker import BrokerError, LocalKafka, port_base

#: Private one-node brokers (2 ports: listener and controller), by user: offset of the first port.
PRIVATE_BROKERS: dict[str, int] = {
    "core/test_indefinite": 300,
    "recipes/sync/test_dual_write_broker": 400,  # and the two fallbacks below
    "recipes/sync/test_dual_write_broker#2": 420,
    "recipes/sync/test_dual_write_broker#3": 440,
    "testing/test_broker_cluster_id": 470,
    "core/test_producer_timeouts": 520,
    "recipes/test_writer_outage": 560,
    "aio/test_loop_stall": 1000,
    "recipes/aio/test_async_dual_write_loop": 1020,
    "logs/outage": 1040,
    "django/test_django_orders_http": 1060,
    "control/test_timeouts": 1400,
}

#: Other ranges ``[first, end)`` a test binds or searches for free ports in, by user.
OTHER_RANGES: dict[str, tuple[int, int]] = {
    "cli/test_cli_sasl (searches)": (592, 992),
    "control/test_tls broker, 4 ports (searches)": (1500, 1600),
    "testing/test_broker_lifecycle, 3-node clusters and two one-node ones": (1200, 1260),
    "spark/_standalone (searches)": (1700, 1800),
    "spark connect: the shared session's server (+1800), the crash tests' servers (1810-1849)": (1800, 1850),
    "recipes/aio/test_async_dual_write_http servers": (1850, 1852),
    "recipes/test_writer_outage database proxy": (1860, 1861),
    "django/test_django_orders_http gunicorn": (1862, 1863),
    "recipes/pool/test_celery_prefork redis": (1870, 1871),
    "ports nothing listens on (closed_port)": (1900, 2000),
}

#: Ports a private broker of :data:`PRIVATE_BROKERS` takes from its offset (listener, controller).
BROKER_PORTS = 2


def port_of(user: str) -> int:
    """The first port of ``user``'s private broker in this checkout's block."""
    try:
        return port_base() + PRIVATE_BROKERS[user]
    except KeyError:
        raise KeyError(f"{user!r} has no slot in harness.ports.PRIVATE_BROKERS") from None


def spark_connect_port() -> int:
    """The Spark Connect port of the tests' shared SparkSession (tests/conftest.py's ``spark``)."""
    return port_base() + 1800


def spark_connect_server_port() -> int:
    """A free port for a Spark Connect server of its own (the crash tests'), in this checkout's block."""
    for port in range(port_base() + 1810, port_base() + 1850):
        if is_closed(port):
            return port
    pytest.fail("no free Spark Connect port in this checkout's block")


def is_closed(port: int) -> bool:
    """Nothing listens on ``port`` of the loopback interface."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def closed_port() -> int:
    """A port of this checkout's block that nothing listens on (a dead broker's address)."""
    first, end = OTHER_RANGES["ports nothing listens on (closed_port)"]
    for port in range(port_base() + end - 1, port_base() + first - 1, -1):
        if is_closed(port):
            return port
    pytest.fail("no closed port in this checkout's block")


@contextmanager
def private_broker(user: str, **kwargs: Any) -> Iterator[LocalKafka]:
    """A fresh one-node broker only ``user`` talks to, at its registered port; wiped afterwards.

    Never shared: the name carries the process id, so a broker another run
    left on these ports is not taken for this one (its ports are then taken,
    and the start fails with a clear error).
    """
    base = port_of(user)
    kafka = LocalKafka(base_port=base, name=f"private-{user.replace('/', '-')}-{base}-{os.getpid()}", **kwargs)
    with started(kafka, f"the private broker of {user}"):
        yield kafka


@contextmanager
def started(kafka: LocalKafka, what: str) -> Iterator[LocalKafka]:
    """Start ``kafka`` (the test fails, clearly, if it cannot), and wipe it afterwards."""
    try:
        kafka.start()
    except BrokerError as exc:
        kafka.wipe()
        pytest.fail(f"could not start {what}: {exc}", pytrace=False)
    try:
        yield kafka
    finally:
        kafka.wipe()
