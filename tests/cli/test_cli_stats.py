"""stats, pending-offsets, stuck, --watch, --otel, --prometheus: the operator's view, on one node and on three.

One set of situations per cluster, set up once for the module, and several
commands asserted over it:

* a prepared dual-write transaction of a killed process whose database
  committed it (its state row names it): ``orders-<u>-0``;
* a prepared dual-write transaction of a killed process in no state table:
  ``orders-<u>-1`` (the pool's other id; it shares partition 0 with ``-0``);
* a Spark-sink-style batch left open: ``k2pc-spark-<u>-0`` / ``-1`` (the
  sink's ``<prefix><sink id>-<partition>`` ids, records open on both partitions);
* an offsets-only transaction holding a consumer group's offsets, and another
  holding a brand-new group's first offsets (the group never committed);
* a plain open transaction: ``plain-<u>``;
* a *hanging* transaction, open on ``hang-<u>``'s partition 0 although no
  coordinator has it open (conftest.make_hanging_transaction).

Every figure is asserted exactly: the LSO and HW the fixture created (its
records' offsets), measured with plain confluent-kafka, and Kafka's own
``TransactionsCommand`` judges the coordinators' and the hanging view.  The
stuck-transaction policy runs last: it must refuse ``orders-<u>-0`` (the
database committed it; recovery then commits it) and abort every other one;
``kafka2pc abort`` ends the hanging one.  Then plain confluent-kafka and
``TransactionsCommand`` must find nothing of this module left open.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka import TopicPartition as KafkaTopicPartition
from kafka2pc.cli._errors import ExitCode

from kafka2pc import TopicAndPartition, TransactionAdmin
from kafka2pc.aio import AsyncTransactionAdmin
from kafka2pc.testing import create_topic, drain
from kafka2pc.testing.broker import LocalKafka

REPO = Path(__file__).resolve().parents[2]
OPEN_STATES = {"Ongoing", "PrepareCommit", "PrepareAbort", "PrepareEpochFence"}


@dataclass
class Situations:
    bootstrap: str
    topic: str
    u: str
    prepared: dict[str, Any]  # tid -> conftest.PreparedTxn
    group: str
    offsets_tid: str
    fresh_group: str
    fresh_tid: str
    hanging: Any  # conftest.HangingTransaction
    db_url: str
    harness: Any  # conftest.CliHarness

    def cli(self, *args: str, **kwargs: Any) -> Any:
        # These tests check what the commands report, not how long they wait: a loaded CI machine once
        # kept the broker from answering for the default 15 s, so they give it 60 s.
        return self.harness.run_cli("-b", self.bootstrap, "--timeout", "60", *args, **kwargs)

    def assert_shape(self, document: Any, kind: str) -> None:
        self.harness.assert_documented_shape(document, kind)

    @property
    def committed_tid(self) -> str:
        return f"orders-{self.u}-0"

    @property
    def mine(self) -> set[str]:
        return {*self.prepared, self.offsets_tid, self.fresh_tid}

    def created_offsets(self) -> dict[tuple[str, int], tuple[int, int]]:
        """``(LSO, HW)`` per partition as the fixture made them: every record it wrote is in an open transaction."""
        offsets: dict[tuple[str, int], list[int]] = {}
        for txn in self.prepared.values():
            for partition, offset, _ in txn.records:
                offsets.setdefault((txn.topic, partition), []).append(offset)
        created = {key: (min(found), max(found) + 1) for key, found in offsets.items()}
        created[(self.hanging.topic, self.hanging.partition)] = (0, self.hanging.records)
        return created


@pytest.fixture(scope="module", params=["one-node", "three-nodes"])
def situations(
    request: pytest.FixtureRequest, kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory, cli_harness: Any
) -> Iterator[Situations]:
    if request.param == "one-node":
        bootstrap, replicas = kafka_bootstrap, 1
    else:
        bootstrap, replicas = LocalKafka.up(brokers=3).bootstrap_servers, 3
    u = "u" + uuid.uuid4().hex[:6]  # never all digits: "plain-<u>" is its own prefix
    topic = create_topic(bootstrap, partitions=2, replication_factor=replicas)
    hang_topic = create_topic(bootstrap, partitions=1, replication_factor=replicas)
    procs: list[subprocess.Popen[bytes]] = []
    prepared = cli_harness.spawn_killed(
        bootstrap, procs, topic, 2,
        ("prepared", f"orders-{u}-0", 2), ("prepared", f"orders-{u}-1", 1),
        ("prepared", f"k2pc-spark-{u}-0", 2), ("prepared", f"k2pc-spark-{u}-1", 2),
        ("prepared", f"plain-{u}", 1),
    )
    # The group commits an offset, then a transaction sends its next offsets and stays open.
    group, offsets_tid = f"consume-to-db-{u}", f"offsets-{u}"
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    _commit_when_the_group_coordinator_is_ready(consumer, KafkaTopicPartition(topic, 0, 1))
    producer = _offsets_in_an_open_transaction(bootstrap, offsets_tid, consumer, KafkaTopicPartition(topic, 0, 2))
    # A brand-new group: its very first offsets are pending in an open transaction.
    fresh_group, fresh_tid = f"fresh-{u}", f"fresh-offsets-{u}"
    fresh_consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": fresh_group, "enable.auto.commit": False})
    fresh_producer = _offsets_in_an_open_transaction(bootstrap, fresh_tid, fresh_consumer,
                                                     KafkaTopicPartition(topic, 1, 1))
    hanging = cli_harness.make_hanging_transaction(bootstrap, hang_topic, 0, 3)
    # The dual write's state table: the database committed orders-<u>-0's prepared state.
    db_path = tmp_path_factory.mktemp("stats") / "state.db"
    engine = sa.create_engine(f"sqlite:///{db_path}")
    with engine.begin() as conn:
        conn.execute(sa.text(
            "CREATE TABLE kafka_transaction_state (transactional_id VARCHAR(255) PRIMARY KEY, "
            "prepared_txn_state VARCHAR(255), updated_at TIMESTAMP)"
        ))
        conn.execute(sa.text("INSERT INTO kafka_transaction_state VALUES (:t, :s, CURRENT_TIMESTAMP)"),
                     {"t": f"orders-{u}-0", "s": prepared[f"orders-{u}-0"].states[0]})
        conn.execute(sa.text("CREATE TABLE kafka_writer_lease (transactional_id VARCHAR(255) PRIMARY KEY)"))
        conn.execute(sa.text("INSERT INTO kafka_writer_lease VALUES (:a), (:b)"),
                     {"a": f"orders-{u}-0", "b": f"orders-{u}-1"})
    engine.dispose()
    try:
        yield Situations(bootstrap, topic, u, prepared, group, offsets_tid, fresh_group, fresh_tid, hanging,
                         f"sqlite:///{db_path}", cli_harness)
    finally:
        cli_harness.reap(procs)
        consumer.close()
        fresh_consumer.close()
        with TransactionAdmin({"bootstrap.servers": bootstrap}) as admin:
            for tid in (*prepared, offsets_tid, fresh_tid):
                admin.force_terminate_transaction(tid, only_ongoing=True)
            tp = TopicAndPartition(hang_topic, 0)
            for held in admin.describe_producers(tp):
                if held.producer_id == hanging.producer_id and held.current_txn_start_offset >= 0:
                    admin.abort_partition_transaction(tp, held.producer_id, held.producer_epoch)
        del producer, fresh_producer


def _offsets_in_an_open_transaction(
    bootstrap: str, tid: str, consumer: Consumer, offset: KafkaTopicPartition
) -> Producer:
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": tid,
                         "transaction.timeout.ms": 900_000})  # open for the whole module, however slow
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.send_offsets_to_transaction([offset], consumer.consumer_group_metadata(), 30)
    return producer


def _commit_when_the_group_coordinator_is_ready(consumer: Consumer, offset: KafkaTopicPartition) -> None:
    """A fresh cluster creates ``__consumer_offsets`` on the first commit: NOT_COORDINATOR until it is loaded."""
    deadline = time.monotonic() + 60
    while True:
        try:
            consumer.commit(offsets=[offset], asynchronous=False)
            return
        except KafkaException as exc:
            retriable = exc.args[0].code() in (KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
                                               KafkaError.COORDINATOR_NOT_AVAILABLE)
            if not retriable or time.monotonic() > deadline:
                raise
        consumer.poll(0.2)




def test_stats_tells_every_figure_exactly(situations: Situations) -> None:
    s = situations
    created = s.created_offsets()
    assert created[(s.topic, 0)] == (0, 5) and created[(s.topic, 1)] == (0, 3)  # what the scenarios wrote
    assert {key: s.harness.measured_offsets(s.bootstrap, *key) for key in created} == created  # plain confluent-kafka

    run = s.cli("stats", "-o", "json")
    assert run.returncode == 0, run
    doc = run.json()
    s.assert_shape(doc, "stats")
    held = {(p["topic"], p["partition"]): p for p in doc["partitions"]}
    for key, (lso, hw) in created.items():
        entry = held[key]
        assert (entry["last_stable_offset"], entry["high_watermark"], entry["held_back"]) == (lso, hw, hw - lso), entry
    for partition in (0, 1):
        entry = held[(s.topic, partition)]
        writers = {tid for tid, p in s.prepared.items() if any(r[0] == partition for r in p.records)}
        [pinning] = [tid for tid, p in s.prepared.items() if [partition, 0, 0] in p.records]  # its record is at the LSO
        assert set(entry["transactional_ids"]) == writers and entry["transactional_ids"][0] == pinning, entry
        assert (entry["holding_transactional_id"], entry["hanging"]) == (pinning, False), entry
        assert entry["holding_producer_id"] == _producer_id(s, pinning)
    hanging = held[(s.hanging.topic, s.hanging.partition)]
    assert hanging == {
        "topic": s.hanging.topic, "partition": 0, "last_stable_offset": 0, "high_watermark": 3, "held_back": 3,
        "held_back_for_ms": doc["time_ms"] - s.hanging.written_ms, "holding_transactional_id": None,
        "holding_producer_id": s.hanging.producer_id, "hanging": True, "transactional_ids": [],
    }

    # Per prefix, each partition once: orders-<u>-0 and -1 share partition 0 (5 + 3 records, not 5 + 3 + 5).
    prefixes = {p["prefix"]: p for p in doc["prefixes"]}
    figures = {name: (p["open"], p["held_back_partitions"], p["held_back"]) for name, p in prefixes.items()}
    assert figures[f"orders-{s.u}"] == (2, 2, 8)
    assert figures[f"k2pc-spark-{s.u}"] == (2, 2, 8)
    assert figures[f"plain-{s.u}"] == (1, 1, 5)
    assert figures[f"offsets-{s.u}"][:2] == (1, 1) and figures[f"fresh-offsets-{s.u}"][:2] == (1, 1)

    # Kafka's own TransactionsCommand: the coordinators' counts, and the one hanging transaction.
    # (Other tests' transactions share the broker and may end meanwhile: the counts are compared over a
    # stats run between two listings that agree.)
    for _ in range(3):
        listed = s.harness.transactions_command(s.bootstrap, "list")
        counted = s.cli("stats", "-o", "json").json()
        if s.harness.transactions_command(s.bootstrap, "list") == listed:
            break
    states = {row["TransactionalId"]: row["TransactionState"] for row in listed}
    assert {tid: states[tid] for tid in s.mine} == dict.fromkeys(s.mine, "Ongoing")
    assert {c["coordinator_id"]: c["transactions"] for c in counted["coordinators"]} == dict(
        Counter(int(row["Coordinator"]) for row in listed))
    assert {c["coordinator_id"]: c["open"] for c in counted["coordinators"] if c["open"]} == dict(
        Counter(int(row["Coordinator"]) for row in listed if row["TransactionState"] in OPEN_STATES))
    judged = s.harness.transactions_command(s.bootstrap, "find-hanging", "--topic", s.hanging.topic)
    assert [(r["Partition"], r["ProducerId"], r["StartOffset"]) for r in judged] == [
        ("0", str(s.hanging.producer_id), "0")]
    assert s.harness.transactions_command(
        s.bootstrap, "find-hanging", "--topic", s.topic, "--max-transaction-timeout", "0") == []

    pending = {g["group_id"]: g for g in doc["pending_offsets"]}
    assert (pending[s.group]["held_by"], pending[s.group]["partitions"]) == (
        [s.offsets_tid], [{"topic": s.topic, "partition": 0}])
    assert (pending[s.fresh_group]["held_by"], pending[s.fresh_group]["partitions"]) == (
        [s.fresh_tid], [{"topic": s.topic, "partition": 1}])

    table = s.cli("stats")
    assert table.returncode == 0, table
    lines = table.stdout.splitlines()
    [hanging_row] = [line for line in lines if line.startswith(f"{s.hanging.topic}-0 ")]
    assert f"(hanging: no coordinator has it open; producer {s.hanging.producer_id})" in hanging_row, table
    [orders_row] = [line.split() for line in lines if line.startswith(f"orders-{s.u} ")]
    assert orders_row[:4] == [f"orders-{s.u}", "2", "2", "8"], table
    for text in (f"{s.topic}-0", f"k2pc-spark-{s.u}", s.group, s.fresh_group, s.offsets_tid, "PARTITIONS HELD BACK"):
        assert text in table.stdout, table

    watched = s.cli("stats", "--watch", "0.2", "--count", "2", "-o", "json")
    assert watched.returncode == 0, watched
    lines = watched.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith('{"version": 2') for line in lines), watched


def _producer_id(s: Situations, tid: str) -> int:
    with TransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
        info = admin.describe_transaction(tid)
    assert info is not None
    return info.description.producer_id


def _console_exports(stdout: str) -> list[dict[str, Any]]:
    """The JSON documents OpenTelemetry's console exporter printed, one per export."""
    decoder, docs, at = json.JSONDecoder(), [], 0
    while (at := _skip_space(stdout, at)) < len(stdout):
        doc, at = decoder.raw_decode(stdout, at)
        docs.append(doc)
    return docs


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _otel_points(export: dict[str, Any]) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    found: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for resource in export["resource_metrics"]:
        for scope in resource["scope_metrics"]:
            for metric in scope["metrics"]:
                found[metric["name"]] = [(p["value"], p["attributes"]) for p in metric["data"]["data_points"]]
    return found


def _figures(doc: dict[str, Any]) -> dict[str, Counter[tuple[Any, ...]]]:
    """The ``stats`` JSON as the metrics carry it: name -> {(prefix or coordinator or '', value)}, ages rounded."""
    from kafka2pc.cli._metrics import METRICS

    return {m.name: Counter((tuple(sorted(a.items())), round(v) if m.unit == "s" else v) for v, a in m.points(doc))
            for m in METRICS}


def _settled(doc: dict[str, Any]) -> dict[str, Counter[tuple[Any, ...]]]:
    """The figures of a ``stats`` document but its ages: what two collections a moment apart share."""
    from kafka2pc.cli._metrics import METRICS

    return {name: figures for name, figures in _figures(doc).items()
            if next(m for m in METRICS if m.name == name).unit != "s"}


def test_otel_and_the_prometheus_endpoint_export_the_json_figures(situations: Situations) -> None:
    """One export per cycle, the figures of ``stats -o json``; every metric the dashboard queries is scraped."""
    s = situations
    from kafka2pc.cli._metrics import METRICS, prometheus_label

    # (Other tests' transactions share the broker and may end meanwhile: an export is compared with two
    # stats documents around it that agree.)
    for _ in range(3):
        before = s.cli("stats", "-o", "json").json()
        exported = s.cli("stats", "--otel", "--watch", "0.2", "--count", "1")  # the console exporter: JSON
        after = s.cli("stats", "-o", "json").json()
        if _settled(before) == _settled(after):
            break
    assert exported.returncode == 0, exported
    [export] = _console_exports(exported.stdout)  # --count 1: collected once, exported once
    points = _otel_points(export)
    assert points["kafka2pc.cluster.collection.failures"] == [(0, {})]
    for metric in METRICS:
        seen = Counter((tuple(sorted(a.items())), round(v) if metric.unit == "s" else v)
                       for v, a in points[metric.otel_name])
        if metric.unit == "s":  # ages: seconds apart
            assert {k for k, _ in seen} == {k for k, _ in _figures(after)[metric.name]}, metric
        else:
            assert seen == _figures(after)[metric.name], metric

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = subprocess.Popen(
        [s.harness.console_script(), "-b", s.bootstrap, "--timeout", "60", "stats",
         "--prometheus", f"127.0.0.1:{port}", "--watch", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        _scrape_until(url, "kafka2pc_cluster_partitions_held_back", endpoint)
        for _ in range(3):
            doc = s.cli("stats", "-o", "json").json()
            time.sleep(1.5)  # a collection (every second) that started after this document's
            families = _scrape_until(url, "kafka2pc_cluster_partitions_held_back", endpoint)
            if _settled(s.cli("stats", "-o", "json").json()) == _settled(doc):
                break
    finally:
        endpoint.send_signal(signal.SIGINT)
        out, err = endpoint.communicate(timeout=60)
    assert endpoint.returncode == 0, (out, err)
    assert families["kafka2pc_cluster_collection_failures"]["samples"] == [("kafka2pc_cluster_collection_failures_total",
                                                                           {}, 0.0)]
    expected = _figures(doc)
    for metric in METRICS:
        samples = families[metric.prometheus_name]["samples"]
        seen = Counter((tuple(sorted((k.replace("kafka2pc_", "kafka2pc."), v) for k, v in labels.items())),
                        round(value) if metric.unit == "s" else value) for _, labels, value in samples)
        if metric.unit == "s":
            assert {k for k, _ in seen} == {k for k, _ in expected[metric.name]}, metric
        else:
            assert seen == expected[metric.name], metric
    assert prometheus_label("kafka2pc.prefix") == "kafka2pc_prefix"

    # Every cluster metric a dashboard panel queries is served, with the labels the panel uses.
    dashboard = json.loads((REPO / "dashboards" / "kafka2pc.json").read_text())
    queried = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    cluster_queries = [e for e in queried if "kafka2pc_cluster_" in e]
    assert len(cluster_queries) >= 8
    for expr in cluster_queries:
        for name in re.findall(r"kafka2pc_cluster_\w+", expr):
            family = name.removesuffix("_total") if name.endswith("_total") else name
            assert family in families, (name, sorted(families))
            labels = {k for _, sample_labels, _ in families[family]["samples"] for k in sample_labels}
            for used in re.findall(r"by \(([^)]*)\)", expr):
                assert {u.strip() for u in used.split(",")} <= labels, (expr, labels)


def _scrape_until(url: str, wanted: str, proc: subprocess.Popen[str]) -> dict[str, dict[str, Any]]:
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:  # noqa: S310  (a local test endpoint)
                text = answer.read().decode()
        except OSError:
            text = ""
        families = {f.name: {"type": f.type, "samples": [(x.name, dict(x.labels), x.value) for x in f.samples]}
                    for f in text_string_to_metric_families(text)}
        if wanted in families:
            return families
        assert time.monotonic() < deadline, f"{url} never served {wanted}: {text[:2000]}"
        time.sleep(0.5)


def test_pending_offsets_and_in_doubt_watch(situations: Situations) -> None:
    s = situations
    run = s.cli("pending-offsets", "-o", "json")
    assert run.returncode == 0, run
    s.assert_shape(run.json(), "pending_offsets")
    groups = {g["group_id"]: (g["held_by"], g["partitions"]) for g in run.json()["groups"]}
    assert groups[s.group] == ([s.offsets_tid], [{"topic": s.topic, "partition": 0}])
    assert groups[s.fresh_group] == ([s.fresh_tid], [{"topic": s.topic, "partition": 1}])  # never committed before
    table = s.cli("pending-offsets")
    assert s.group in table.stdout and s.offsets_tid in table.stdout and s.fresh_group in table.stdout, table

    async def through_the_async_admin() -> tuple[dict[str, list[TopicAndPartition]], TopicAndPartition]:
        async with AsyncTransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
            return await admin.pending_offset_groups(), await admin.consumer_offsets_partition(s.group)

    pending, offsets_tp = asyncio.run(through_the_async_admin())
    assert pending[s.group] == [TopicAndPartition(s.topic, 0)]
    assert pending[s.fresh_group] == [TopicAndPartition(s.topic, 1)]
    with TransactionAdmin({"bootstrap.servers": s.bootstrap}) as sync_admin:
        holder = sync_admin.describe_transaction(s.offsets_tid)
        assert holder is not None and offsets_tp in holder.description.partitions  # what the broker chose

    watched = s.cli("in-doubt", "--db-url", s.db_url, "--watch", "0.2", "--count", "2", "-o", "json")
    assert watched.returncode == 0, watched
    docs = [json.loads(line) for line in watched.stdout.strip().splitlines()]
    assert len(docs) == 2 and all(d["entries"][0]["decision"] == "commit" for d in docs), watched


def test_stuck_policy_refuses_what_the_database_committed_and_aborts_the_rest(situations: Situations) -> None:
    """``stuck``, then ``recover`` and ``abort``; after them nothing of this module is open or held back."""
    s = situations
    db = ["--db-url", s.db_url, "--lease-table", "kafka_writer_lease"]
    missing_db = s.cli("stuck", "--older-than", "0s", "--abort")
    assert missing_db.returncode == ExitCode.USAGE and "--db-url" in missing_db.stderr, missing_db

    dry = s.cli("stuck", "--older-than", "0", "--abort", *db, "-o", "json")
    assert dry.returncode == 0, dry
    s.assert_shape(dry.json(), "stuck")
    assert (dry.json()["command"], dry.json()["dry_run"]) == ("stuck", True)
    actions = {e["transactional_id"]: e for e in dry.json()["transactions"] if e["transactional_id"] in s.mine}
    assert set(actions) == s.mine
    assert actions[s.committed_tid]["action"] == "refuse" and actions[s.committed_tid]["heuristic_if_aborted"]
    assert {tid for tid, e in actions.items() if e["action"] == "would-abort"} == s.mine - {s.committed_tid}
    audit = [line for line in dry.stderr.splitlines() if line.startswith("audit ")]
    assert len(audit) == len(dry.json()["transactions"]) and all(" stuck would-abort " in line or " stuck refuse "
                                                                 in line or " stuck leave " in line for line in audit)
    deprecated = s.cli("find-hanging", "--older-than", "0s", "--abort", *db, "-o", "json")
    assert deprecated.returncode == 0 and deprecated.json()["command"] == "find-hanging", deprecated
    assert "'find-hanging --older-than' is deprecated; use 'kafka2pc stuck --older-than'" in deprecated.stderr
    with TransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
        assert all(admin.describe_transaction(tid).state == "Ongoing" for tid in s.mine)  # type: ignore[union-attr]

    done = s.cli("stuck", "--older-than", "0s", "--abort", "--yes", *db)
    assert done.returncode == ExitCode.ATTENTION == 10, done  # done as asked; one refused, for a person
    assert "REFUSE (HEURISTIC if aborted)" in done.stdout and "kafka2pc recover" in done.stdout, done
    assert sum(line.startswith("audit ") and " aborted " in line for line in done.stderr.splitlines()) >= 6
    with TransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
        states = {tid: admin.describe_transaction(tid).state for tid in s.mine}  # type: ignore[union-attr]
    assert states.pop(s.committed_tid) == "Ongoing"
    assert set(states.values()) <= {"PrepareAbort", "CompleteAbort", "Empty"}, states  # Empty: aborted, fenced
    pending = s.cli("pending-offsets", "-o", "json")
    assert not {s.group, s.fresh_group} & {g["group_id"] for g in pending.json()["groups"]}, pending

    recovered = s.cli("recover", "--db-url", s.db_url, "-o", "json")
    assert recovered.returncode == 0, recovered
    [entry] = recovered.json()["entries"]
    assert (entry["transactional_id"], entry["decision"], entry["heuristic"]) == (s.committed_tid, "commit", False)
    aborted = s.cli("abort", "--topic", s.hanging.topic, "--partition", "0", "--start-offset", "0", "--yes")
    # 3 records and the abort marker: nothing held back any more.
    assert aborted.returncode == 0 and "last stable offset now 4 (high watermark 4)" in aborted.stdout, aborted

    # Nothing left open, as plain confluent-kafka and Kafka's TransactionsCommand see it.
    for topic, partition in s.created_offsets():
        lso, hw = s.harness.measured_offsets(s.bootstrap, topic, partition)
        assert lso == hw, (topic, partition, lso, hw)  # the records, then their markers: nothing held back
    listed = {r["TransactionalId"]: r["TransactionState"] for r in s.harness.transactions_command(s.bootstrap, "list")}
    assert not {tid for tid in s.mine if listed.get(tid) in OPEN_STATES}, listed
    for topic in (s.topic, s.hanging.topic):
        assert s.harness.transactions_command(
            s.bootstrap, "find-hanging", "--topic", topic, "--max-transaction-timeout", "0") == []
    committed = s.prepared[s.committed_tid]
    values = sorted((r.value or b"").decode() for r in drain(s.bootstrap, s.topic))
    assert values == sorted(f"{s.committed_tid}-t0-r{i}" for i in range(len(committed.records)))

    after = s.cli("stats", "-o", "json")
    assert after.returncode == 0, after
    s.assert_shape(after.json(), "stats")
    assert not [p for p in after.json()["partitions"] if p["topic"] in (s.topic, s.hanging.topic)], after
