"""The block of loopback ports the local brokers live in, and what listens there."""

from __future__ import annotations

import os
import socket
import struct

from kafka2pc.testing._common import BrokerError

DEFAULT_PORT_BASE = 20000
"""First port of the block the local brokers use (below the kernel's ephemeral range).

Ports inside the ephemeral range (32768–60999 on Linux) can be held by any outgoing
connection at the moment a broker binds them.  Every local listener therefore lives in
``[port_base(), port_base() + 2000)``; ``$KAFKA2PC_PORT_BASE`` moves the block, so two
checkouts on one machine can each run their own brokers.
"""


def port_base() -> int:
    """First port of this process's block of local listener ports (``$KAFKA2PC_PORT_BASE``)."""
    raw = os.environ.get("KAFKA2PC_PORT_BASE", str(DEFAULT_PORT_BASE))
    try:
        base = int(raw)
    except ValueError:
        raise BrokerError(f"KAFKA2PC_PORT_BASE must be an integer, not {raw!r}") from None
    if not 1024 <= base <= 32768 - 2000:
        raise BrokerError(
            f"KAFKA2PC_PORT_BASE={base} must leave its 2000 ports between 1024 and 32767 "
            "(below the kernel's ephemeral range)"
        )
    return base


def worker_port_base(base: int, worker: int) -> int:
    """The port block of the ``worker``-th parallel test process (pytest-xdist's ``gw<worker>``) of a run in ``base``.

    Worker 0 keeps ``base``; worker ``n`` takes ``base + 4000 * n`` (the block right after ``base`` stays free
    for a second run beside this one, as CI's), or ``base - 4000 * n`` when that would reach the ephemeral range.
    Workers past those (pytest-xdist names a worker that replaces a crashed one ``gw<next>``) take the blocks
    ``base - 4000 * k`` the first ones left unused, nearest first.
    """
    if worker < 0:
        raise BrokerError(f"a worker index is 0 or more, not {worker}")
    ups = [first for k in range(1, 9) if 1024 <= (first := base + 4000 * k) <= 32768 - 2000]
    downs = [first for k in range(1, 9) if 1024 <= (first := base - 4000 * k) <= 32768 - 2000]
    blocks = [base, *ups, *downs[len(ups):], *downs[:len(ups)]]
    if worker < len(blocks):
        return blocks[worker]
    raise BrokerError(f"no room for the port block of worker {worker} beside KAFKA2PC_PORT_BASE={base} "
                      f"({len(blocks)} blocks of 2000 ports fit below 32768, 4000 apart)")


def _answers_kafka(port: int, timeout: float = 1.0) -> bool:
    """True when a Kafka broker answers an ApiVersions request on ``127.0.0.1:port``.

    An open port alone is not enough: another process may hold it (the node's
    JVM then fails to bind and exits a moment later), and a node registers
    with the controller before its listener serves requests.
    """
    client = b"kafka2pc-ready"
    correlation = 0x6B327063
    request = struct.pack(">hhih", 18, 0, correlation, len(client)) + client  # ApiVersions v0, empty body
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(struct.pack(">i", len(request)) + request)
            reply = b""
            while len(reply) < 8:
                chunk = s.recv(8 - len(reply))
                if not chunk:
                    return False
                reply += chunk
    except OSError:
        return False
    answered: int = struct.unpack(">i", reply[4:8])[0]
    return answered == correlation


def _port_free(port: int) -> bool:
    """True when a broker could bind ``127.0.0.1:port`` now.

    Binds as the JVM does (``SO_REUSEADDR``), so a port held by a listener *or*
    by any other bound socket (an outgoing connection) counts as taken, and a
    closed connection lingering in TIME_WAIT does not.
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
