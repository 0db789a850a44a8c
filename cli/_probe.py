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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kafka2pc import unreachable_reason

from ._errors import CliFailure, ExitCode

if TYPE_CHECKING:
    from kafka2pc import KafkaTransactionError

__all__ = ["UNREACHABLE_HINT", "diagnose_unreachable", "preflight", "unreachable"]

_MAX_DIAGNOSIS_S = 10.0
UNREACHABLE_HINT = "check --bootstrap-server, the network and security.protocol; raise --timeout if the cluster is slow"


def unreachable(detail: str) -> CliFailure:
    """The one-line "Kafka unreachable" failure (exit code 5), with what to check."""
    return CliFailure(f"Kafka unreachable: {detail} ({UNREACHABLE_HINT})", ExitCode.UNREACHABLE)


def preflight(bootstrap_servers: str, timeout_s: float) -> CliFailure | None:
    """A failure naming each bootstrap address and why it is unreachable, or ``None`` if one accepts connections."""
    why = unreachable_reason(bootstrap_servers, timeout_s, bound="--timeout")
    return unreachable(why) if why is not None else None


def diagnose_unreachable(config: Mapping[str, Any], timeout_s: float) -> KafkaTransactionError | None:
    """A more precise error than "unreachable", or ``None`` if there is nothing more to say."""
    from kafka2pc import TransactionAdmin

    with TransactionAdmin(config) as admin:
        return admin.diagnose_connection(timeout=min(timeout_s, _MAX_DIAGNOSIS_S))
