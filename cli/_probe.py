"""Why is the cluster unreachable?  The CLI's entry to :meth:`TransactionAdmin.diagnose_connection`.

When the control plane gives up and the connection is secured, the CLI asks
once, briefly, for the real cause (a failed SASL authentication or TLS
handshake) and reports *that* (wrong credentials are exit code 6, not 5).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kafka2pc import KafkaTransactionError, TransactionAdmin

__all__ = ["diagnose_unreachable"]

_MAX_DIAGNOSIS_S = 10.0


def diagnose_unreachable(config: Mapping[str, Any], timeout_s: float) -> KafkaTransactionError | None:
    """A more precise error than "unreachable", or ``None`` if there is nothing more to say."""
    with TransactionAdmin(config) as admin:
        return admin.diagnose_connection(timeout=min(timeout_s, _MAX_DIAGNOSIS_S))
