"""``kafka2pc stats --otel``: the cluster-wide figures of ``stats`` as OpenTelemetry gauges.

A small long-running exporter: every ``every_s`` seconds it collects the
``stats`` document and exports, through OpenTelemetry's SDK (meter
``kafka2pc.cluster``):

* ``kafka2pc.cluster.partitions.held_back`` (Gauge, {partition}): partitions
  whose last stable offset an open transaction pins below the high watermark;
* ``kafka2pc.cluster.records.held_back`` (Gauge, {record}), per ``kafka2pc.prefix``;
* ``kafka2pc.cluster.transaction.oldest_open.age`` (Gauge, s): per
  transactional-id prefix (attribute ``kafka2pc.prefix``), the age of its
  oldest open transaction;
* ``kafka2pc.cluster.consumer_groups.pending_offsets`` (Gauge, {group}):
  consumer groups whose offsets are pending in an open transaction.

The exporter is OTLP when ``opentelemetry-exporter-otlp`` is installed (set
``OTEL_EXPORTER_OTLP_ENDPOINT`` as usual), else the console.  Alert on
``oldest_open.age`` approaching the transaction timeout and on
``pending_offsets`` > 0 for long.  :class:`ClusterGauges` registers the
same gauges on any meter provider, for a process that already runs an SDK.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kafka2pc import __version__
from kafka2pc._extras import missing_extra

from ._render import repeat

try:
    from opentelemetry import metrics
    from opentelemetry.metrics import CallbackOptions, Observation
except ImportError as exc:
    raise missing_extra(exc, extra="otel", feature="kafka2pc stats --otel") from exc

__all__ = ["PREFIX", "SCOPE", "ClusterGauges", "run_exporter"]

SCOPE = "kafka2pc.cluster"
PREFIX = "kafka2pc.prefix"

log = logging.getLogger(__name__)


class ClusterGauges:
    """The ``stats`` figures as observable gauges on ``meter_provider`` (default: the global one).

    ``collect()`` returns a ``stats`` document (:func:`kafka2pc.cli._stats.collect_stats`);
    it is called at most once per collection, by the first gauge observed.
    """

    def __init__(
        self, collect: Callable[[], dict[str, Any]], *, meter_provider: metrics.MeterProvider | None = None
    ) -> None:
        self._collect = collect
        self._lock = threading.Lock()
        self._doc: dict[str, Any] | None = None
        self._taken: float | None = None
        self.failures = 0
        meter = metrics.get_meter(SCOPE, __version__, meter_provider=meter_provider)
        for name, callback, unit, description in (
            ("partitions.held_back", self._partitions, "{partition}",
             "Partitions whose last stable offset an open transaction holds below the high watermark"),
            ("records.held_back", self._records, "{record}",
             "Records held back from read_committed consumers, per transactional-id prefix"),
            ("transaction.oldest_open.age", self._oldest, "s",
             "Age of the oldest open transaction, per transactional-id prefix"),
            ("consumer_groups.pending_offsets", self._pending, "{group}",
             "Consumer groups whose offsets are pending in an open transaction"),
        ):
            meter.create_observable_gauge(f"{SCOPE}.{name}", callbacks=[callback], unit=unit, description=description)

    def _document(self) -> dict[str, Any] | None:
        with self._lock:
            if self._taken is None or time.monotonic() - self._taken > 1.0:  # one attempt per collection
                try:
                    self._doc = self._collect()
                except Exception as exc:  # noqa: BLE001  (a failed collection is no points, not a dead exporter)
                    self.failures += 1
                    log.error("kafka2pc stats --otel: collection failed: %s", exc)
                    self._doc = None
                self._taken = time.monotonic()
            return self._doc

    def _partitions(self, options: CallbackOptions) -> Iterable[Observation]:
        doc = self._document()
        return [] if doc is None else [Observation(len(doc["partitions"]))]

    def _records(self, options: CallbackOptions) -> Iterable[Observation]:
        doc = self._document()
        return [] if doc is None else [Observation(p["held_back"], {PREFIX: p["prefix"]}) for p in doc["prefixes"]]

    def _oldest(self, options: CallbackOptions) -> Iterable[Observation]:
        doc = self._document()
        return [] if doc is None else [
            Observation(p["oldest_open_ms"] / 1000.0, {PREFIX: p["prefix"]}) for p in doc["prefixes"]
        ]

    def _pending(self, options: CallbackOptions) -> Iterable[Observation]:
        doc = self._document()
        return [] if doc is None else [Observation(len(doc["pending_offsets"]))]


def _exporter() -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (  # type: ignore[import-not-found]
            OTLPMetricExporter,
        )

        return OTLPMetricExporter()
    except ImportError:
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return ConsoleMetricExporter()


def run_exporter(
    collect: Callable[[], dict[str, Any]],
    *,
    every_s: float,
    count: int | None = None,
    exporter: Any = None,
    timeout_s: float = 15.0,
) -> None:
    """Export the gauges every ``every_s`` seconds, ``count`` times (``None``: until Ctrl-C).

    ``timeout_s`` bounds one collection, ``collect()`` and the SDK's work (the
    caller bounds ``collect()`` itself by less); a collection past it is logged
    at ERROR and exports no points, and the exporter goes on.
    """
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    if exporter is None:
        exporter = _exporter()
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=10**9)  # exported below, by hand
    provider = MeterProvider(metric_readers=[reader])
    ClusterGauges(collect, meter_provider=provider)
    try:
        repeat(every_s, count, lambda: _collect_once(reader, timeout_s))
    finally:
        provider.shutdown()


def _collect_once(reader: Any, timeout_s: float) -> None:
    from opentelemetry.sdk.metrics import MetricsTimeoutError

    try:
        reader.collect(timeout_millis=timeout_s * 1000.0)
    except MetricsTimeoutError:  # a slow collection exports nothing this time; the exporter goes on
        log.error("kafka2pc stats --otel: a collection took more than %g s; nothing exported this time", timeout_s)
