"""The pure parts of stats and the stuck-transaction policy, the OpenTelemetry gauges and the Prometheus names (no broker)."""

from __future__ import annotations

import io
import logging
import time
from typing import Any

import pytest
from kafka2pc.cli._metrics import COLLECTION_FAILURES, METRICS, by_name, prometheus_name
from kafka2pc.cli._otel import PREFIX, ClusterGauges, run_exporter
from kafka2pc.cli._stats import collect_stats, id_prefix
from kafka2pc.cli._stuck import REFUSED_REASON, decide
from opentelemetry.metrics import Observation
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


DOCUMENT: dict[str, Any] = {
    "coordinators": [{"coordinator_id": 1, "open": 3}, {"coordinator_id": 2, "open": 0}],
    "partitions": [{"topic": "t", "partition": 0, "hanging": False}, {"topic": "t", "partition": 1, "hanging": True}],
    "prefixes": [{"prefix": "orders", "held_back": 5, "held_back_partitions": 2, "oldest_open_ms": 90_000},
                 {"prefix": "k2pc-spark-q1", "held_back": 2, "held_back_partitions": 1, "oldest_open_ms": 1_500}],
    "pending_offsets": [{"group_id": "g"}],
}


def test_cluster_gauges_export_the_stats_figures() -> None:
    calls: list[int] = []

    def collect() -> dict[str, Any]:
        calls.append(1)
        return DOCUMENT

    reader = InMemoryMetricReader()
    ClusterGauges(collect, meter_provider=MeterProvider(metric_readers=[reader]))
    points = _points(reader)
    assert len(calls) == 1  # one collection serves every gauge
    assert points["kafka2pc.cluster.partitions.held_back"] == [(2, {})]
    assert points["kafka2pc.cluster.partitions.hanging"] == [(1, {})]
    assert points["kafka2pc.cluster.consumer_groups.pending_offsets"] == [(1, {})]
    assert sorted(points["kafka2pc.cluster.transaction.oldest_open.age"], key=str) == sorted(
        [(90.0, {PREFIX: "orders"}), (1.5, {PREFIX: "k2pc-spark-q1"})], key=str)
    assert (5, {PREFIX: "orders"}) in points["kafka2pc.cluster.records.held_back"]
    assert (2, {PREFIX: "orders"}) in points["kafka2pc.cluster.prefix.partitions.held_back"]
    assert sorted(points["kafka2pc.cluster.transactions.open"], key=str) == [
        (0, {"kafka2pc.coordinator_id": "2"}), (3, {"kafka2pc.coordinator_id": "1"})]
    assert points["kafka2pc.cluster.collection.failures"] == [(0, {})]

    def failing() -> dict[str, Any]:
        raise TimeoutError("no broker")

    reader = InMemoryMetricReader()
    gauges = ClusterGauges(failing, meter_provider=MeterProvider(metric_readers=[reader]))
    points = _points(reader)
    assert all(not values for name, values in points.items() if name != COLLECTION_FAILURES.otel_name)
    assert points[COLLECTION_FAILURES.otel_name] == [(1, {})]  # counted
    assert gauges.failures == 1


def test_count_1_collects_once_and_exports_once(caplog: pytest.LogCaptureFixture) -> None:
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

    calls: list[int] = []

    def collect() -> dict[str, Any]:
        calls.append(1)
        return DOCUMENT

    exported = io.StringIO()
    run_exporter(collect, every_s=0.1, count=1, exporter=ConsoleMetricExporter(out=exported))
    assert len(calls) == 1
    assert exported.getvalue().count('"kafka2pc.cluster.partitions.held_back"') == 1

    def failing() -> dict[str, Any]:
        raise TimeoutError("no broker")

    exported = io.StringIO()
    with caplog.at_level(logging.ERROR, logger="kafka2pc.cli._otel"):
        gauges = run_exporter(failing, every_s=0.1, count=2, exporter=ConsoleMetricExporter(out=exported))
    assert gauges.failures == 2
    assert [r.getMessage() for r in caplog.records] == ["kafka2pc stats: collection failed: unexpected error: "
                                                        "TimeoutError: no broker (run with --debug)"] * 2


class _StubAdmin:
    """Observations of a cluster, as TransactionAdmin returns them (the roll-up is pure logic over them)."""

    def __init__(self, infos: list[TransactionInfo], lags: list[Any]) -> None:
        self.infos, self.lags = infos, lags

    def list_transactions(self) -> list[TransactionInfo]:
        return self.infos

    def held_back_partitions(self) -> list[Any]:
        return self.lags

    def describe_producers(self, tp: TopicAndPartition) -> list[Any]:
        return []

    def pending_offset_groups(self) -> dict[str, list[TopicAndPartition]]:
        return {}


def test_a_prefix_counts_a_shared_partition_once() -> None:
    """Two open transactions of one prefix on d1-1 (LSO 0, HW 4) and one on d1-0 (9 held back): 13, not 17."""
    from kafka2pc import PartitionLag

    shared, other = PartitionLag("d1", 1, 0, 4), PartitionLag("d1", 0, 1, 10)

    def info(tid: str, pid: int, *lags: PartitionLag) -> TransactionInfo:
        desc = TransactionDescription(tid, "Ongoing", pid, 0, 60_000, 1_000 + pid,
                                      tuple(TopicAndPartition(lag.topic, lag.partition) for lag in lags), 1)
        return TransactionInfo(desc, 5_000 - pid, lags)

    admin = _StubAdmin([info("w-1", 1, shared, other), info("w-2", 2, shared)], [other, shared])
    doc = collect_stats(admin, now_ms=10_000)  # type: ignore[arg-type]
    [prefix] = doc["prefixes"]
    assert (prefix["prefix"], prefix["open"], prefix["held_back_partitions"], prefix["held_back"]) == ("w", 2, 2, 13)
    assert [(p["partition"], p["transactional_ids"]) for p in sorted(doc["partitions"], key=lambda p: p["partition"])
            ] == [(0, ["w-1"]), (1, ["w-1", "w-2"])]


class _RecordingMeter:
    """Records the instruments kafka2pc.otel creates (name, unit, kind); instruments are OpenTelemetry's no-ops."""

    def __init__(self) -> None:
        from opentelemetry.metrics import NoOpMeter

        self.created: list[tuple[str, str, str]] = []
        self._noop = NoOpMeter("recording")

    def __getattr__(self, method: str) -> Any:
        kind = method.removeprefix("create_")

        def create(name: str, *args: Any, unit: str = "", **kwargs: Any) -> Any:
            self.created.append((name, unit, kind))
            return getattr(self._noop, method)(name, *args, unit=unit, **kwargs)

        return create


class _RecordingProvider:
    def __init__(self) -> None:
        self.meter = _RecordingMeter()

    def get_meter(self, *args: Any, **kwargs: Any) -> Any:
        return self.meter


def _translated_by_opentelemetry(instruments: list[tuple[str, str, str]]) -> dict[str, str]:
    """OpenTelemetry's own Prometheus exporter's names for ``(name, unit, kind)`` instruments."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY, generate_latest

    reader = PrometheusMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    try:
        meter = provider.get_meter("translation-check")
        for name, unit, kind in instruments:
            if kind == "counter":
                meter.create_counter(name, unit=unit).add(1)
            elif kind == "histogram":
                meter.create_histogram(name, unit=unit).record(1.0)
            else:
                meter.create_observable_gauge(name, callbacks=[lambda options: [Observation(1.0)]], unit=unit)
        text = generate_latest(REGISTRY).decode()
    finally:
        provider.shutdown()  # unregisters the reader's collector from prometheus-client's registry
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    found = {}
    for name, unit, kind in instruments:
        [match] = [n for n in names if n.startswith(name.replace(".", "_"))]
        found[name] = match + ("_total" if kind == "counter" and not match.endswith("_total") else "")
    return found


def test_prometheus_names_are_the_collectors_translation() -> None:
    """Ours (--prometheus) equal OpenTelemetry's exporter's, for the cluster's and the application's metrics."""
    from kafka2pc.otel import Telemetry

    provider = _RecordingProvider()
    Telemetry(meter_provider=provider)  # type: ignore[arg-type]
    app = [(n, u, "counter" if k == "counter" else "histogram" if k == "histogram" else "gauge")
           for n, u, k in provider.meter.created]
    assert {n for n, _, _ in app} >= {"kafka2pc.transactions.committed", "kafka2pc.heuristic_outcomes",
                                      "kafka2pc.transaction.commit.duration", "kafka2pc.transactions.in_doubt"}
    cluster = [(m.otel_name, m.unit, "counter" if m.counter else "gauge") for m in (*METRICS, COLLECTION_FAILURES)]
    theirs = _translated_by_opentelemetry(app + cluster)
    ours = {name: prometheus_name(name, unit, counter=kind == "counter") for name, unit, kind in app + cluster}
    assert ours == theirs
    assert set(by_name().values()) == {1}  # no two cluster metrics share a Prometheus name

    # Every metric a dashboard panel queries is one of them (histograms as _bucket/_count/_sum).
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "dashboards" / "kafka2pc.json").read_text())
    exported = set(ours.values())
    exported |= {f"{ours[n]}_{part}" for n, _, k in app if k == "histogram" for part in ("bucket", "count", "sum")}
    queried = {name for panel in dashboard["panels"] for target in panel.get("targets", [])
               for name in re.findall(r"kafka2pc_\w+", _without_labels(target["expr"]))}
    assert queried and queried <= exported, queried - exported


def test_the_exporter_outlives_a_collection_past_its_bound(caplog: pytest.LogCaptureFixture) -> None:
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

    calls: list[float] = []

    def slow() -> dict[str, Any]:  # the first collection overruns the bound, the second does not
        calls.append(time.monotonic())
        time.sleep(0.6 if len(calls) == 1 else 0.0)
        return {"coordinators": [], "partitions": [], "prefixes": [], "pending_offsets": []}

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


def _without_labels(expr: str) -> str:
    """A PromQL expression without its label matchers ``{...}`` and groupings ``by (...)``: metric names remain."""
    import re

    return re.sub(r"\{[^}]*\}|\bby \([^)]*\)", " ", expr)


def test_transactions_command_tables_are_parsed() -> None:
    """kafka2pc.testing.kafka_tools reads the tables Kafka's TransactionsCommand prints (padded, tab-joined)."""
    from kafka2pc.testing.kafka_tools import TransactionsCommandError, parse_table

    text = ("Topic         \tPartition\tProducerId\tProducerEpoch\tCoordinatorEpoch\tStartOffset\tLastTimestamp\t"
            "Duration(min)\t\nt-5ae5dc5ad54d\t1        \t987654321 \t0            \t-1              \t0          \t"
            "1795815097425\t60           \t\n")
    assert parse_table(text) == [{"Topic": "t-5ae5dc5ad54d", "Partition": "1", "ProducerId": "987654321",
                                  "ProducerEpoch": "0", "CoordinatorEpoch": "-1", "StartOffset": "0",
                                  "LastTimestamp": "1795815097425", "Duration(min)": "60"}]
    assert parse_table("TransactionalId\tCoordinator\tProducerId\tTransactionState\t\n") == []
    # A transactional id may hold spaces, quotes and tabs' neighbours: only the tab separates cells.
    odd = "dw-1-o'brien'; DROP TABLE x; --\"é"
    assert parse_table(f"TransactionalId\tCoordinator\tProducerId\tTransactionState\t\n"
                       f"{odd}\t1          \t113       \tEmpty           \t\n") == [
        {"TransactionalId": odd, "Coordinator": "1", "ProducerId": "113", "TransactionState": "Empty"}]
    assert parse_table("") == []
    with pytest.raises(TransactionsCommandError):
        parse_table("TransactionalId\tCoordinator\nonly-one-cell\n")


def test_the_dashboard_imports_as_it_is() -> None:
    """dashboards/kafka2pc.json: one Prometheus data source input, unique panel ids, every target on it."""
    import json
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "dashboards" / "kafka2pc.json").read_text())
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["uid"] == "kafka2pc" and dashboard["title"] == "kafka2pc" and dashboard["id"] is None
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    queries = [p for p in panels if p["type"] != "row"]
    assert len(queries) == 12
    for panel in queries:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}" and panel["targets"], panel["title"]
        assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" and t["expr"] for t in panel["targets"])
        assert panel["description"], panel["title"]
