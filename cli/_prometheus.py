"""``kafka2pc stats --prometheus [HOST]:PORT``: the ``stats`` figures on a Prometheus scrape endpoint.

For operators without an OpenTelemetry Collector.  A background loop collects
the ``stats`` document every ``--watch`` seconds (default 30); a scrape
answers at once with the last collection's figures, under the names the
Collector's Prometheus exporter gives the ``stats --otel`` gauges
(:func:`kafka2pc.cli._metrics.prometheus_name`): one dashboard serves both.
A failed collection is logged once at ERROR, counted in
``kafka2pc_cluster_collection_failures_total``, and leaves no gauge in the
scrape until a collection succeeds again (figures of an earlier collection
would be stale).

Built on ``prometheus-client`` (the Prometheus project's own client, no
dependencies of its own, stable API), not on OpenTelemetry's Prometheus
exporter: that one is still a beta and pins the OpenTelemetry SDK to its own
patch release, which the ``cli`` extra would then force on every
application that installs it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from kafka2pc._extras import missing_extra

from ._metrics import COLLECTION_FAILURES, METRICS, prometheus_label
from ._render import repeat

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError as exc:
    raise missing_extra(exc, extra="cli", feature="kafka2pc stats --prometheus") from exc

__all__ = ["StatsCollector", "serve"]

log = logging.getLogger(__name__)


class StatsCollector(Collector):
    """A prometheus-client collector over the last ``stats`` document :meth:`refresh` collected."""

    def __init__(self, collect: Callable[[], dict[str, Any]]) -> None:
        self._collect = collect
        self._lock = threading.Lock()
        self._doc: dict[str, Any] | None = None
        self.failures = 0

    def refresh(self) -> dict[str, Any] | None:
        """Collect now; the document, or ``None`` when the collection failed (logged at ERROR and counted)."""
        try:
            doc: dict[str, Any] | None = self._collect()
        except Exception as exc:  # noqa: BLE001  (a failed collection is counted, not a dead endpoint)
            from ._errors import classify

            log.error("kafka2pc stats: collection failed: %s", classify(exc)[1])
            doc = None
            with self._lock:
                self.failures += 1
        with self._lock:
            self._doc = doc
        return doc

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            doc, failures = self._doc, self.failures
        counter = CounterMetricFamily(COLLECTION_FAILURES.prometheus_name.removesuffix("_total"),
                                      COLLECTION_FAILURES.description)
        counter.add_metric([], failures)
        yield counter
        if doc is None:
            return
        for metric in METRICS:
            points = metric.points(doc)
            labels = sorted({key for _, attrs in points for key in attrs})
            family = GaugeMetricFamily(metric.prometheus_name, metric.description,
                                       labels=[prometheus_label(k) for k in labels])
            for value, attrs in points:
                family.add_metric([attrs.get(k, "") for k in labels], value)
            yield family


def serve(
    collect: Callable[[], dict[str, Any]], address: tuple[str, int], *, every_s: float, count: int | None = None
) -> StatsCollector:
    """Serve the figures on ``http://HOST:PORT/metrics``; collect every ``every_s`` s, ``count`` times (None: Ctrl-C).

    The HTTP server runs in a daemon thread and stops with the command.
    """
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    collector = StatsCollector(collect)
    registry.register(collector)
    host, port = address
    server, thread = start_http_server(port, addr=host, registry=registry)
    log.info("serving the stats figures on http://%s:%d/metrics", host, port)
    try:
        repeat(every_s, count, lambda: None if collector.refresh() is None else None)
    finally:
        server.shutdown()
        thread.join(timeout=5)
    return collector
