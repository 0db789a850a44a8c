"""Why is the cluster unreachable?  A second opinion from librdkafka.

The control plane's client (kafka-python) cannot tell a failed SASL
authentication or TLS handshake from a dropped connection: the broker closes
the socket, and all the operator sees is "unable to bootstrap".  librdkafka
reports the real cause through its error callback, so when the control plane
gives up and the connection is secured, the CLI asks librdkafka once, briefly,
and reports *that* (wrong credentials are exit code 6, not 5).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kafka2pc._exceptions import AuthorizationError, BrokerUnavailableError, KafkaTransactionError

__all__ = ["diagnose_unreachable"]


def diagnose_unreachable(config: Mapping[str, Any], timeout_s: float) -> KafkaTransactionError | None:
    """A more precise error than "unreachable", or ``None`` if librdkafka sees nothing more either."""
    protocol = str(config.get("security.protocol", "PLAINTEXT")).upper()
    if protocol == "PLAINTEXT":
        return None
    from confluent_kafka.admin import AdminClient

    from kafka2pc._control import _connection_only

    errors: list[Any] = []
    probe_config = dict(_connection_only(config))
    probe_config.update({"error_cb": errors.append, "log_level": 0})
    try:
        admin = AdminClient(probe_config)
    except Exception:  # noqa: BLE001 - a config librdkafka refuses: nothing more to learn
        return None
    deadline = time.monotonic() + min(timeout_s, 10.0)
    while time.monotonic() < deadline:
        admin.poll(0.1)
        for error in errors:
            name = error.name()
            if name == "_AUTHENTICATION":
                return AuthorizationError(f"authentication failed: {error.str()}", error_name=name)
            if name == "_SSL":
                return BrokerUnavailableError(f"TLS handshake failed: {error.str()}", error_name=name)
    return None
