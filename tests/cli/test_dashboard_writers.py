"""The dashboard's writer panels, over what an instrumented producer really exports to Prometheus.

A ``TwoPhaseCommitProducer`` instrumented by ``kafka2pc.otel`` commits and
aborts transactions on the test broker; OpenTelemetry's own Prometheus
exporter (what the Collector's translation gives) serves its metrics; every
writer panel of ``dashboards/kafka2pc.json`` must find the metrics it queries,
with the labels it groups by and the component it selects.  (The cluster
panels are checked against ``kafka2pc stats --prometheus`` in
``test_cli_stats.py``; the Spark panels' and the heuristic panel's names, which
need a Spark run or a heuristic outcome to have points, by the translation in
``test_cli_stats_policy.py``.)
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path

from opentelemetry.sdk.metrics import MeterProvider

from kafka2pc import TwoPhaseCommitProducer

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "kafka2pc.json"


def test_writer_panels_find_their_metrics(kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kafka2pc.otel import Telemetry

    reader = PrometheusMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    try:
        topic, tid = topic_factory(), f"dashboard-{uuid.uuid4().hex[:8]}"
        producer = Telemetry(meter_provider=provider).instrument_producer(
            TwoPhaseCommitProducer({"bootstrap.servers": kafka_bootstrap, "transactional.id": tid}))
        with producer:
            producer.init_transactions(30)
            for value in (b"committed", b"aborted"):
                producer.begin_transaction()
                producer.produce(topic, value=value)
                producer.prepare_transaction(30)
                if value == b"committed":
                    producer.commit_transaction(30)
                else:
                    producer.abort_transaction(30)
            samples = {(s.name, frozenset(s.labels.items())) for f in
                       text_string_to_metric_families(generate_latest(REGISTRY).decode()) for s in f.samples}
    finally:
        provider.shutdown()

    dashboard = json.loads(DASHBOARD.read_text())
    writer_exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])
                    if 'kafka2pc_component=~"producer|dual_write"' in t["expr"]]
    assert len(writer_exprs) == 4  # transactions per second (2) and commit latency (2)
    for expr in writer_exprs:
        [name] = re.findall(r"(kafka2pc_\w+)\{", expr)
        grouped = {label.strip() for used in re.findall(r"by \(([^)]*)\)", expr) for label in used.split(",")}
        mine = [dict(labels) for sample, labels in samples
                if sample == name and dict(labels).get("kafka2pc_transactional_id") == tid]
        assert mine, (name, sorted(n for n, _ in samples if n.startswith("kafka2pc")))
        assert all(labels["kafka2pc_component"] == "producer" for labels in mine)
        assert all(grouped - {"le"} <= set(labels) for labels in mine), (expr, mine)
    committed = [dict(labels) for name, labels in samples if name == "kafka2pc_transactions_committed_total"]
    assert any(labels.get("kafka2pc_transactional_id") == tid for labels in committed)
    in_doubt = [dict(labels) for name, labels in samples if name == "kafka2pc_transactions_in_doubt"]
    assert {"kafka2pc_component": "producer", "kafka2pc_transactional_id": tid}.items() <= next(
        (labels for labels in in_doubt if labels.get("kafka2pc_transactional_id") == tid), {}).items(), in_doubt
