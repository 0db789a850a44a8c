"""Fixtures of the OpenTelemetry tests: SDK providers with in-memory readers (the SparkSession is tests/conftest.py's)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _otelkit import Collected
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kafka2pc.otel import Telemetry


@pytest.fixture
def otel() -> Iterator[Collected]:
    """A :class:`Telemetry` on private SDK providers (cumulative metrics, every span kept)."""
    reader = InMemoryMetricReader()
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[reader])
    yield Collected(Telemetry(meter_provider=meter_provider, tracer_provider=tracer_provider), reader, exporter)
    meter_provider.shutdown()
    tracer_provider.shutdown()
