"""Can anything be reached at the bootstrap addresses?  A TCP pre-flight, before any Kafka request.

The control plane waits out its whole timeout when no broker answers (a
refused connection is retried like a slow one), which is right for a
cluster that is restarting and wrong at the start of a job or a command
pointed at the wrong address.  :func:`unreachable_reason` answers in
milliseconds when every address is refused or cannot be resolved; an
address that accepts a TCP connection (a healthy broker, or one still
starting, which the kernel accepts for) ends the check at once.  It is
public core API (``kafka2pc.unreachable_reason``): the CLI and the Spark
recipe's writes run it before their first Kafka request, and so can any job.
"""

from __future__ import annotations

import concurrent.futures
import socket
import time

__all__ = ["unreachable_reason"]


def _split(address: str) -> tuple[str, int] | None:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _try(host: str, port: int, deadline: float, bound: str) -> str | None:
    """``None`` if ``host:port`` accepts a TCP connection before ``deadline``; else why not."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:  # getaddrinfo has no timeout of its own
        infos = pool.submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM).result(
            timeout=max(0.01, deadline - time.monotonic())
        )
    except socket.gaierror as exc:
        return f"cannot resolve host name {host!r} ({exc.strerror})"
    except concurrent.futures.TimeoutError:
        return f"resolving {host!r} took longer than {bound}"
    finally:
        pool.shutdown(wait=False)
    reasons = []
    for family, kind, proto, _, sockaddr in infos:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return f"no TCP connection within {bound}"
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(remaining)
                sock.connect(sockaddr)
                return None
        except ConnectionRefusedError:
            reasons.append("connection refused")
        except TimeoutError:
            return f"no TCP connection within {bound}"
        except OSError as exc:
            reasons.append(exc.strerror or type(exc).__name__)
    return "; ".join(dict.fromkeys(reasons)) or "no address"


def unreachable_reason(bootstrap_servers: str, timeout_s: float, *, bound: str | None = None) -> str | None:
    """Why no bootstrap address accepts a TCP connection (each address named), or ``None`` if one does.

    A pre-flight before a job's or a command's first Kafka request: a wrong
    address or a cluster that is down is told in milliseconds, where a Kafka
    client would wait out its whole timeout.  Only TCP is tried (no Kafka
    request, no TLS handshake): ``None`` does not mean the cluster is
    healthy.  Blocks at most ``timeout_s`` (DNS and connects together);
    ``bound`` is how messages name that limit (default ``"<timeout_s> s"``).
    An address that is not ``host:port`` ends the check with ``None``: the
    client reports it.

    Example::

        reason = kafka2pc.unreachable_reason("kafka-1:9092,kafka-2:9092", 5.0)
        if reason is not None:
            raise SystemExit(f"Kafka is unreachable: {reason}")
    """
    deadline = time.monotonic() + timeout_s
    limit = bound if bound is not None else f"{timeout_s:g} s"
    failures = []
    for address in bootstrap_servers.split(","):
        if not address.strip():
            continue
        parsed = _split(address)
        if parsed is None:
            return None
        why = _try(*parsed, deadline, limit)
        if why is None:
            return None
        failures.append(f"{address.strip()}: {why}")
    return "; ".join(failures) if failures else None
