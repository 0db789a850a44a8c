"""Why is the cluster unreachable?  A second opinion from librdkafka.

kafka-python cannot tell a failed SASL authentication or TLS handshake from a
dropped connection: the broker closes the socket, and all it reports is
"unable to bootstrap".  librdkafka reports the real cause through its error
callback, so when the control plane cannot connect over a secured listener,
a short-lived librdkafka admin client is asked once, briefly.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from kafka2pc._exceptions import (
    AuthorizationError,
    BrokerUnavailableError,
    KafkaTransactionError,
)

__all__ = ["diagnose_unreachable"]

_POLL_S = 0.1
# With TLS 1.3 a refused client certificate arrives after the handshake, as a
# transport error carrying the TLS alert ("ssl/tls alert bad certificate").
_TLS_FAILURE = re.compile(r"SSL routines|ssl/tls alert|certificate verify failed|SSL handshake", re.IGNORECASE)
_CLIENT_CERTIFICATE_REFUSED = re.compile(r"alert (bad certificate|certificate required|unknown ca)", re.IGNORECASE)


def diagnose_unreachable(librdkafka_connection: Mapping[str, Any], timeout_s: float) -> KafkaTransactionError | None:
    """A more precise error than "unreachable", or ``None`` if librdkafka sees nothing more either.

    Only secured connections are diagnosed (a PLAINTEXT listener has no
    handshake to fail).  Blocks at most ``timeout_s``.
    """
    protocol = str(librdkafka_connection.get("security.protocol", "PLAINTEXT")).upper()
    if protocol == "PLAINTEXT" or timeout_s <= 0:
        return None
    from confluent_kafka.admin import AdminClient

    errors: list[Any] = []
    probe_config = dict(librdkafka_connection)
    probe_config.update({"error_cb": errors.append, "log_level": 0})
    try:
        admin = AdminClient(probe_config)
    except Exception:  # noqa: BLE001 - a config librdkafka refuses: nothing more to learn
        return None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        admin.poll(min(_POLL_S, max(0.0, deadline - time.monotonic())))
        for error in errors:
            name = error.name()
            if name == "_AUTHENTICATION":
                return AuthorizationError(f"authentication failed: {error.str()}", error_name=name)
            if name == "_SSL" or (name == "_TRANSPORT" and _TLS_FAILURE.search(error.str())):
                return BrokerUnavailableError(f"TLS handshake failed: {error.str()}{_tls_hint(error.str())}",
                                              error_name=name)
    return None


def _tls_hint(text: str) -> str:
    if _CLIENT_CERTIFICATE_REFUSED.search(text):
        return (" (the listener wants a client certificate it trusts: set ssl.certificate.location and "
                "ssl.key.location to a certificate signed by a CA the broker trusts)")
    return ""
