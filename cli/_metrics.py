"""The ``stats`` figures as metrics: one table for the OpenTelemetry gauges and the Prometheus endpoint.

Each :class:`ClusterMetric` names an OpenTelemetry instrument (meter
``kafka2pc.cluster``) and says how to read its points from a ``stats``
document (:func:`kafka2pc.cli._stats.collect_stats`).  ``stats --otel``
exports them through OpenTelemetry's SDK; ``stats --prometheus`` serves the
same points under the names the OpenTelemetry Collector's Prometheus
exporter gives them by default (:func:`prometheus_name`), so one dashboard
(``dashboards/kafka2pc.json``) works behind either.

Only cheap imports here: no OpenTelemetry, no prometheus-client.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COLLECTION_FAILURES",
    "COORDINATOR",
    "METRICS",
    "PREFIX",
    "SCOPE",
    "ClusterMetric",
    "by_name",
    "prometheus_label",
    "prometheus_name",
]

SCOPE = "kafka2pc.cluster"
PREFIX = "kafka2pc.prefix"
COORDINATOR = "kafka2pc.coordinator_id"

Points = list[tuple[float, dict[str, str]]]


@dataclass(frozen=True)
class ClusterMetric:
    """One figure of the ``stats`` document, as a gauge (or, ``counter``, a monotonic sum)."""

    name: str
    """The OpenTelemetry name, under :data:`SCOPE` (``kafka2pc.cluster.<name>``)."""
    unit: str
    description: str
    points: Callable[[dict[str, Any]], Points]
    counter: bool = False

    @property
    def otel_name(self) -> str:
        return f"{SCOPE}.{self.name}"

    @property
    def prometheus_name(self) -> str:
        return prometheus_name(self.otel_name, self.unit, counter=self.counter)


def _per_prefix(field: str, scale: float = 1.0) -> Callable[[dict[str, Any]], Points]:
    return lambda doc: [(p[field] * scale, {PREFIX: p["prefix"]}) for p in doc["prefixes"]]


def _open_per_coordinator(doc: dict[str, Any]) -> Points:
    return [(float(c["open"]), {COORDINATOR: str(c["coordinator_id"])}) for c in doc["coordinators"]]


def _hanging(doc: dict[str, Any]) -> Points:
    return [(float(sum(1 for p in doc["partitions"] if p["hanging"])), {})]


METRICS: tuple[ClusterMetric, ...] = (
    ClusterMetric("partitions.held_back", "{partition}",
                  "Partitions whose last stable offset is below the high watermark, cluster-wide, each once",
                  lambda doc: [(float(len(doc["partitions"])), {})]),
    ClusterMetric("partitions.hanging", "{partition}",
                  "Partitions held back by a transaction no coordinator has open (hanging)", _hanging),
    ClusterMetric("prefix.partitions.held_back", "{partition}",
                  "Partitions held back by open transactions of a transactional-id prefix",
                  _per_prefix("held_back_partitions")),
    ClusterMetric("records.held_back", "{record}",
                  "Records held back on a transactional-id prefix's partitions (each partition once)",
                  _per_prefix("held_back")),
    ClusterMetric("transaction.oldest_open.age", "s",
                  "Age of the oldest open transaction, per transactional-id prefix",
                  _per_prefix("oldest_open_ms", 1 / 1000)),
    ClusterMetric("transactions.open", "{transaction}",
                  "Open transactions, per transaction coordinator (broker id)", _open_per_coordinator),
    ClusterMetric("consumer_groups.pending_offsets", "{group}",
                  "Consumer groups whose offsets are pending in an open transaction",
                  lambda doc: [(float(len(doc["pending_offsets"])), {})]),
)

COLLECTION_FAILURES = ClusterMetric(
    "collection.failures", "{collection}", "Collections of the stats figures that failed (logged at ERROR)",
    lambda doc: [], counter=True,
)

_UNIT_WORDS = {
    "s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds", "min": "minutes",
    "h": "hours", "d": "days", "By": "bytes", "KiBy": "kibibytes", "MiBy": "mebibytes", "%": "percent",
}


def prometheus_name(name: str, unit: str, *, counter: bool) -> str:
    """The name the OpenTelemetry Collector's Prometheus exporter gives a metric, by default.

    Characters other than letters, digits, ``_`` and ``:`` become ``_`` (runs
    of them one); the unit is appended as a word (``s`` -> ``_seconds``;
    an annotation in braces such as ``{record}`` is dropped; ``1`` as a gauge
    is ``_ratio``); a monotonic sum (counter) ends in ``_total``.

    >>> prometheus_name("kafka2pc.transaction.commit.duration", "s", counter=False)
    'kafka2pc_transaction_commit_duration_seconds'
    >>> prometheus_name("kafka2pc.transactions.committed", "{transaction}", counter=True)
    'kafka2pc_transactions_committed_total'
    """
    base = re.sub(r"[^a-zA-Z0-9_:]+", "_", name).strip("_")
    word = re.sub(r"\{[^}]*\}", "", unit).strip()
    if word == "1":
        word = "" if counter else "ratio"
    if word:
        suffix = _UNIT_WORDS.get(word, re.sub(r"[^a-zA-Z0-9_:]+", "_", word))
        if not base.endswith("_" + suffix):
            base = f"{base}_{suffix}"
    if counter and not base.endswith("_total"):
        base += "_total"
    return base


def prometheus_label(attribute: str) -> str:
    """An attribute's label name: characters other than letters, digits and ``_`` become ``_``."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", attribute)


def by_name() -> Counter[str]:
    """How many metrics share each Prometheus name (all 1: a unit test keeps it so)."""
    return Counter(m.prometheus_name for m in (*METRICS, COLLECTION_FAILURES))
