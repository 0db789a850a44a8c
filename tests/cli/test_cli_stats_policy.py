"""The pure parts of stats and the stuck-transaction policy, and the OpenTelemetry gauges (no broker)."""

from __future__ import annotations

import io
import logging
import time
from typing import Any

import pytest
from kafka2pc.cli._otel import PREFIX, ClusterGauges, run_exporter
from kafka2pc.cli._stats import id_prefix
from kafka2pc.cli._stuck import REFUSED_REASON, decide
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kafka2pc import TopicAndPartition, TransactionAdmin, TransactionDescription, TransactionInfo


def test_id_prefix_groups_pool_and_sink_ids() -> None:
    assert {id_prefix(f"orders-{n}") for n in range(32)} == {"orders"}
    assert {id_prefix(f"k2pc-spark-q7-{p}") for p in range(4)} == {"k2pc-spark-q7"}
    assert id_prefix("billing") == "billing" and id_prefix("billing_3") == "billing" and id_prefix("-1") == "-1"
    assert id_prefix("orders-12-3") == "orders-12"  # one numbered suffix only


@pytest.mark.parametrize(
    ("group", "partition"),
    [("dbg-group-1", 39),  # as a Kafka 4.4 broker placed it (DescribeTransactions)
     ("hello", 99162322 % 50), ("", 0)],
)
def test_consumer_offsets_partition_is_the_brokers(group: str, partition: int) -> None:
    from kafka2pc._control._groups import offsets_partition

    assert offsets_partition(group, 50) == partition


def _info(state: str = "Ongoing") -> TransactionInfo:
    desc = TransactionDescription("orders-1", state, 7, 0, 60_000, 1, (TopicAndPartition("t", 0),), 1)
    return TransactionInfo(desc, 5_000, ())


def test_policy_refuses_what_the_database_committed_and_aborts_the_rest() -> None:
    assert decide(_info(), "k2pc1:...", committed_in_db=True, leased=True) == ("refuse", REFUSED_REASON)
    assert decide(_info(), "k2pc1:...", committed_in_db=False, leased=False)[0] == "abort"
    assert decide(_info(), None, committed_in_db=False, leased=True)[0] == "abort"
    assert decide(_info(), None, committed_in_db=False, leased=False) == ("abort", "in no state table")
    for ending in ("PrepareCommit", "PrepareAbort"):
        assert decide(_info(ending), "k2pc1:...", committed_in_db=True, leased=False)[0] == "leave"


def _points(reader: InMemoryMetricReader) -> dict[str, list[tuple[Any, dict[str, Any]]]]:
    data = reader.get_metrics_data()
    found: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
    for resource in data.resource_metrics if data is not None else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found[metric.name] = [(p.value, dict(p.attributes or {})) for p in metric.data.data_points]
    return found


def test_cluster_gauges_export_the_stats_figures() -> None:
    document = {
        "partitions": [{"topic": "t", "partition": 0}, {"topic": "t", "partition": 1}],
        "prefixes": [{"prefix": "orders", "held_back": 5, "oldest_open_ms": 90_000},
                     {"prefix": "k2pc-spark-q1", "held_back": 2, "oldest_open_ms": 1_500}],
        "pending_offsets": [{"group_id": "g"}],
    }
    calls: list[int] = []

    def collect() -> dict[str, Any]:
        calls.append(1)
        return document

    reader = InMemoryMetricReader()
    ClusterGauges(collect, meter_provider=MeterProvider(metric_readers=[reader]))
    points = _points(reader)
    assert len(calls) == 1  # one collection serves every gauge
    assert points["kafka2pc.cluster.partitions.held_back"] == [(2, {})]
    assert points["kafka2pc.cluster.consumer_groups.pending_offsets"] == [(1, {})]
    assert sorted(points["kafka2pc.cluster.transaction.oldest_open.age"], key=str) == sorted(
        [(90.0, {PREFIX: "orders"}), (1.5, {PREFIX: "k2pc-spark-q1"})], key=str)
    assert (5, {PREFIX: "orders"}) in points["kafka2pc.cluster.records.held_back"]

    def failing() -> dict[str, Any]:
        raise TimeoutError("no broker")

    reader = InMemoryMetricReader()
    gauges = ClusterGauges(failing, meter_provider=MeterProvider(metric_readers=[reader]))
    assert all(not values for values in _points(reader).values())  # no points, no crash
    assert gauges.failures == 1


def test_the_exporter_outlives_a_collection_past_its_bound(caplog: pytest.LogCaptureFixture) -> None:
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

    calls: list[float] = []

    def slow() -> dict[str, Any]:  # the first collection overruns the bound, the second does not
        calls.append(time.monotonic())
        time.sleep(0.6 if len(calls) == 1 else 0.0)
        return {"partitions": [], "prefixes": [], "pending_offsets": []}

    exported = io.StringIO()
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="kafka2pc.cli._otel"):
        run_exporter(slow, every_s=1.1, count=2, exporter=ConsoleMetricExporter(out=exported), timeout_s=0.2)
    assert len(calls) == 2 and time.monotonic() - started < 5  # bounded, and the second collection ran
    assert [r.getMessage() for r in caplog.records] == [
        "kafka2pc stats --otel: a collection took more than 0.2 s; nothing exported this time"]
    assert "kafka2pc.cluster.partitions.held_back" in exported.getvalue()


def test_admin_entry_points_are_documented() -> None:
    for name in ("pending_offset_groups", "consumer_offsets_partition"):
        assert (getattr(TransactionAdmin, name).__doc__ or "").strip()
