"""Reading what the in-memory OpenTelemetry SDK collected (imported by the tests as ``_otelkit``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kafka2pc.otel import Telemetry


@dataclass
class Collected:
    """The in-memory OpenTelemetry SDK behind one :class:`Telemetry`."""

    telemetry: Telemetry
    reader: InMemoryMetricReader
    exporter: InMemorySpanExporter

    def points(self) -> dict[str, list[Any]]:
        """Metric name -> data points of one collection."""
        found: dict[str, list[Any]] = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data is not None else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    found.setdefault(metric.name, []).extend(metric.data.data_points)
        return found

    def value(self, name: str, **attributes: object) -> float | None:
        """Sum of the points of ``name`` whose attributes include ``attributes`` (``None``: no point)."""
        points = [p for p in self.points().get(name, []) if _matches(p.attributes, attributes)]
        if not points:
            return None
        return sum(float(getattr(p, "value", getattr(p, "count", 0))) for p in points)

    def histogram(self, name: str, **attributes: object) -> tuple[int, float]:
        """``(count, sum)`` of histogram ``name``."""
        points = [p for p in self.points().get(name, []) if _matches(p.attributes, attributes)]
        return sum(p.count for p in points), sum(p.sum for p in points)

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        """Finished spans, oldest first (those called ``name`` only)."""
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]


def _matches(attributes: Any, wanted: dict[str, object]) -> bool:
    return all(attributes.get(k.replace("__", ".")) == v for k, v in wanted.items())
