"""``kafka2pc stats --otel``: the cluster-wide figures of ``stats`` as OpenTelemetry gauges.

A small long-running exporter: every ``every_s`` seconds it collects the
``stats`` document once and exports it once, through OpenTelemetry's SDK
(meter ``kafka2pc.cluster``), the instruments of
:data:`kafka2pc.cli._metrics.METRICS`:

* ``kafka2pc.cluster.partitions.held_back`` ({partition}): partitions whose
  last stable offset is below the high watermark, cluster-wide, each once;
* ``kafka2pc.cluster.partitions.hanging`` ({partition}): those held back by a
  transaction no coordinator has open;
* ``kafka2pc.cluster.prefix.partitions.held_back`` ({partition}) and
  ``kafka2pc.cluster.records.held_back`` ({record}), per transactional-id
  prefix (attribute ``kafka2pc.prefix``), each partition counted once;
* ``kafka2pc.cluster.transaction.oldest_open.age`` (s), per prefix;
* ``kafka2pc.cluster.transactions.open`` ({transaction}), per coordinator
  (attribute ``kafka2pc.coordinator_id``);
* ``kafka2pc.cluster.consumer_groups.pending_offsets`` ({group});
* ``kafka2pc.cluster.collection.failures`` (Counter, {collection}): failed
  collections; each is also logged once at ERROR on stderr.

The exporter is OTLP when ``opentelemetry-exporter-otlp`` is installed (set
``OTEL_EXPORTER_OTLP_ENDPOINT`` as usual), else the console.
:class:`ClusterGauges` registers the same instruments on any meter provider,
for a process that already runs an SDK.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kafka2pc import __version__
from kafka2pc._extras import missing_extra

from ._metrics import COLLECTION_FAILURES, METRICS, PREFIX, SCOPE, ClusterMetric
from ._render import repeat

try:
    from opentelemetry import metrics
    from opentelemetry.metrics import CallbackOptions, Observation
except ImportError as exc:
    raise missing_extra(exc, extra="otel", feature="kafka2pc stats --otel") from exc

__all__ = ["PREFIX", "SCOPE", "ClusterGauges", "run_exporter"]

log = logging.getLogger(__name__)

REUSE_S = 1.0
"""Gauges observed within this long of a collection share it (one collection per export), unless
:meth:`ClusterGauges.expire` was called since (the exporter's loop does, before each export)."""


class ClusterGauges:
    """The ``stats`` figures as observable gauges on ``meter_provider`` (default: the global one).

    ``collect()`` returns a ``stats`` document (:func:`kafka2pc.cli._stats.collect_stats`).
    It is called at most once per export, by the first gauge observed (or by
    :meth:`refresh`).  A collection that raises is logged once at ERROR,
    counted in ``kafka2pc.cluster.collection.failures`` and exports no gauge
    points (figures of an earlier collection would be stale).
    """

    def __init__(
        self, collect: Callable[[], dict[str, Any]], *, meter_provider: metrics.MeterProvider | None = None
    ) -> None:
        self._collect = collect
        self._lock = threading.Lock()
        self._doc: dict[str, Any] | None = None
        self._taken: float | None = None
        self._expired = False
        self.failures = 0
        meter = metrics.get_meter(SCOPE, __version__, meter_provider=meter_provider)
        for metric in METRICS:
            meter.create_observable_gauge(metric.otel_name, callbacks=[self._observer(metric)], unit=metric.unit,
                                          description=metric.description)
        self._failures = meter.create_counter(COLLECTION_FAILURES.otel_name, unit=COLLECTION_FAILURES.unit,
                                              description=COLLECTION_FAILURES.description)
        self._failures.add(0)  # the series exists from the first export on: rate() needs its zero

    def refresh(self) -> dict[str, Any] | None:
        """Collect now; the document, or ``None`` when the collection failed (logged and counted)."""
        with self._lock:
            return self._refresh_locked()

    def _refresh_locked(self) -> dict[str, Any] | None:
        try:
            self._doc = self._collect()
        except Exception as exc:  # noqa: BLE001  (a failed collection is no points, not a dead exporter)
            from ._errors import classify

            self.failures += 1
            self._failures.add(1)
            log.error("kafka2pc stats: collection failed: %s", classify(exc)[1])
            self._doc = None
        self._taken = time.monotonic()
        return self._doc

    def expire(self) -> None:
        """The next gauge observed collects again (the exporter calls it before each export)."""
        with self._lock:
            self._expired = True

    def _document(self) -> dict[str, Any] | None:
        with self._lock:
            if self._expired or self._taken is None or time.monotonic() - self._taken > REUSE_S:
                self._expired = False
                return self._refresh_locked()
            return self._doc

    def _observer(self, metric: ClusterMetric) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            doc = self._document()
            return [] if doc is None else [Observation(value, attrs) for value, attrs in metric.points(doc)]

        return observe


def _exporter() -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (  # type: ignore[import-not-found]
            OTLPMetricExporter,
        )

        return OTLPMetricExporter()
    except ImportError:
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return ConsoleMetricExporter()


def _on_demand_reader(exporter: Any) -> Any:
    """A metric reader that exports when asked (``collect()``), and not once more at shutdown.

    The SDK's periodic reader collects and exports a last time when it shuts
    down: ``--count 1`` then queried Kafka and exported twice.
    """
    from opentelemetry.sdk.metrics.export import MetricReader

    class OnDemandReader(MetricReader):
        def __init__(self) -> None:
            super().__init__(preferred_temporality=getattr(exporter, "_preferred_temporality", None),
                             preferred_aggregation=getattr(exporter, "_preferred_aggregation", None))

        def _receive_metrics(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> None:
            if metrics_data is not None:
                exporter.export(metrics_data, timeout_millis=timeout_millis)

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            exporter.shutdown(timeout_millis=timeout_millis)

    return OnDemandReader()


def run_exporter(
    collect: Callable[[], dict[str, Any]],
    *,
    every_s: float,
    count: int | None = None,
    exporter: Any = None,
    timeout_s: float = 15.0,
) -> ClusterGauges:
    """Collect and export the gauges every ``every_s`` seconds, ``count`` times (``None``: until Ctrl-C).

    Each cycle collects once and exports once.  ``timeout_s`` bounds one
    collection, ``collect()`` and the SDK's work (the caller bounds
    ``collect()`` itself by less); a collection past it is logged at ERROR
    and exports no points, and the exporter goes on.
    """
    from opentelemetry.sdk.metrics import MeterProvider

    if exporter is None:
        exporter = _exporter()
    reader = _on_demand_reader(exporter)
    provider = MeterProvider(metric_readers=[reader])
    gauges = ClusterGauges(collect, meter_provider=provider)
    try:
        repeat(every_s, count, lambda: _collect_once(gauges, reader, timeout_s))
    finally:
        provider.shutdown()
    return gauges


def _collect_once(gauges: ClusterGauges, reader: Any, timeout_s: float) -> None:
    from opentelemetry.sdk.metrics import MetricsTimeoutError

    gauges.expire()
    try:
        reader.collect(timeout_millis=timeout_s * 1000.0)
    except MetricsTimeoutError:  # a slow collection exports nothing this time; the exporter goes on
        log.error("kafka2pc stats --otel: a collection took more than %g s; nothing exported this time", timeout_s)
