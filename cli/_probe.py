"""Why is the cluster unreachable?  A fast pre-flight, and the core's deeper diagnosis.

:func:`preflight` runs before any Kafka request: it resolves every bootstrap
address and opens a TCP connection to it.  When *every* address fails with
a DNS error or a refused connection the command stops at once (exit code 5)
instead of waiting out ``--timeout``; an address that accepts the connection
(a healthy broker, or a stopped one, which the kernel still accepts for) lets
the command go on, bounded by ``--timeout``.

When the control plane gives up and the connection is secured, the CLI asks
once, briefly, for the real cause (a failed SASL authentication or TLS
handshake) through :meth:`kafka2pc.TransactionAdmin.diagnose_connection`, and
reports *that* (wrong credentials are exit code 6, not 5).
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._errors import CliFailure, ExitCode

if TYPE_CHECKING:
    from kafka2pc import KafkaTransactionError

__all__ = ["UNREACHABLE_HINT", "diagnose_unreachable", "preflight", "unreachable"]

_MAX_DIAGNOSIS_S = 10.0
UNREACHABLE_HINT = "check --bootstrap-server, the network and security.protocol; raise --timeout if the cluster is slow"


def unreachable(detail: str) -> CliFailure:
    """The one-line "Kafka unreachable" failure (exit code 5), with what to check."""
    return CliFailure(f"Kafka unreachable: {detail} ({UNREACHABLE_HINT})", ExitCode.UNREACHABLE)


def _split(address: str) -> tuple[str, int] | None:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _try(host: str, port: int, deadline: float) -> str | None:
    """``None`` if ``host:port`` accepts a TCP connection before ``deadline``; else why not."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:  # getaddrinfo has no timeout of its own
        infos = pool.submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM).result(
            timeout=max(0.01, deadline - time.monotonic())
        )
    except socket.gaierror as exc:
        return f"cannot resolve host name {host!r} ({exc.strerror})"
    except concurrent.futures.TimeoutError:
        return f"resolving {host!r} took longer than --timeout"
    finally:
        pool.shutdown(wait=False)
    reasons = []
    for family, kind, proto, _, sockaddr in infos:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "no TCP connection within --timeout"
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(remaining)
                sock.connect(sockaddr)
                return None
        except ConnectionRefusedError:
            reasons.append("connection refused")
        except TimeoutError:
            return "no TCP connection within --timeout"
        except OSError as exc:
            reasons.append(exc.strerror or type(exc).__name__)
    return "; ".join(dict.fromkeys(reasons)) or "no address"


def preflight(bootstrap_servers: str, timeout_s: float) -> CliFailure | None:
    """A failure naming each bootstrap address and why it is unreachable, or ``None`` if one accepts connections."""
    deadline = time.monotonic() + timeout_s
    failures = []
    for address in bootstrap_servers.split(","):
        if not address.strip():
            continue
        parsed = _split(address)
        if parsed is None:
            return None  # not host:port: let the client report it
        why = _try(*parsed, deadline)
        if why is None:
            return None
        failures.append(f"{address.strip()}: {why}")
    return unreachable("; ".join(failures)) if failures else None


def diagnose_unreachable(config: Mapping[str, Any], timeout_s: float) -> KafkaTransactionError | None:
    """A more precise error than "unreachable", or ``None`` if there is nothing more to say."""
    from kafka2pc import TransactionAdmin

    with TransactionAdmin(config) as admin:
        return admin.diagnose_connection(timeout=min(timeout_s, _MAX_DIAGNOSIS_S))
