"""What the local broker's modules share: their error and their cache directory."""

from __future__ import annotations

import os
from pathlib import Path

from kafka2pc import Kafka2pcError


class BrokerError(Kafka2pcError, RuntimeError):
    """The local broker could not be fetched, started or reached (a :class:`~kafka2pc.Kafka2pcError`)."""


def cache_dir() -> Path:
    """Directory for jars and broker state (``$KAFKA2PC_CACHE`` or ``~/.cache/kafka2pc``)."""
    return Path(os.environ.get("KAFKA2PC_CACHE", Path.home() / ".cache" / "kafka2pc"))
