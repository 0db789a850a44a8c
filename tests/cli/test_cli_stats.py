"""stats, pending-offsets, find-hanging --older-than --abort, --watch: the operator's view, on one node and on three.

One set of situations per cluster, set up once for the module, and several
commands asserted over it:

* a prepared dual-write transaction of a killed process whose database
  committed it (its state row names it): ``orders-<u>-0``;
* a prepared dual-write transaction of a killed process in no state table:
  ``orders-<u>-1`` (the pool's other id);
* a Spark-sink-style batch left open: ``k2pc-spark-<u>-0`` / ``-1`` (the
  sink's ``<prefix><sink id>-<partition>`` ids, records open on both partitions);
* an offsets-only transaction holding a consumer group's offsets;
* a plain hanging transaction: ``plain-<u>``.

The abort policy runs last: it must refuse ``orders-<u>-0`` (the database
committed it; recovery then commits it) and abort every other one.  The end
state is checked with a ``read_committed`` consumer and the coordinator's
view (LSO == HW).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass
class Situations:
    bootstrap: str
    topic: str
    u: str
    prepared: dict[str, Any]  # tid -> conftest.PreparedTxn
    group: str
    offsets_tid: str
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
        return {*self.prepared, self.offsets_tid}


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
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": offsets_tid,
                         "transaction.timeout.ms": 900_000})  # open for the whole module, however slow
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.send_offsets_to_transaction(
        [KafkaTopicPartition(topic, 0, 2)], consumer.consumer_group_metadata(), 30
    )
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
        yield Situations(bootstrap, topic, u, prepared, group, offsets_tid, f"sqlite:///{db_path}", cli_harness)
    finally:
        cli_harness.reap(procs)
        consumer.close()
        with TransactionAdmin({"bootstrap.servers": bootstrap}) as admin:
            for tid in (*prepared, offsets_tid):
                admin.force_terminate_transaction(tid, only_ongoing=True)
        del producer


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


def test_stats_shows_who_holds_what_back(situations: Situations) -> None:
    s = situations
    run = s.cli("stats", "-o", "json")
    assert run.returncode == 0, run
    doc = run.json()
    s.assert_shape(doc, "stats")

    held = {(p["topic"], p["partition"]): p for p in doc["partitions"]}
    for partition in (0, 1):
        entry = held[(s.topic, partition)]
        assert entry["held_back"] == entry["high_watermark"] - entry["last_stable_offset"] > 0
        assert entry["holding_transactional_id"] in s.prepared
        assert set(entry["transactional_ids"]) == {tid for tid, p in s.prepared.items()
                                                   if any(r[0] == partition for r in p.records)}
        assert entry["held_back_for_ms"] >= 0
    prefixes = {p["prefix"]: p for p in doc["prefixes"]}
    assert prefixes[f"orders-{s.u}"]["open"] == 2 and prefixes[f"orders-{s.u}"]["held_back"] >= 3
    assert prefixes[f"k2pc-spark-{s.u}"]["open"] == 2
    assert prefixes[f"plain-{s.u}"]["open"] == 1 and prefixes[f"offsets-{s.u}"]["open"] == 1
    assert sum(c["open"] for c in doc["coordinators"]) >= len(s.mine)
    assert all(c["oldest_open"] is not None for c in doc["coordinators"] if c["open"])
    [group] = [g for g in doc["pending_offsets"] if g["group_id"] == s.group]
    assert group["held_by"] == [s.offsets_tid]
    assert group["partitions"] == [{"topic": s.topic, "partition": 0}]

    table = s.cli("stats")
    assert table.returncode == 0, table
    for text in (f"{s.topic}-0", f"k2pc-spark-{s.u}", f"orders-{s.u}", s.group, s.offsets_tid, "PARTITIONS HELD BACK"):
        assert text in table.stdout, table

    watched = s.cli("stats", "--watch", "0.2", "--count", "2", "-o", "json")
    assert watched.returncode == 0, watched
    lines = watched.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith('{"version": 1') for line in lines), watched


def test_pending_offsets_and_in_doubt_watch(situations: Situations) -> None:
    s = situations
    run = s.cli("pending-offsets", "-o", "json")
    assert run.returncode == 0, run
    s.assert_shape(run.json(), "pending_offsets")
    assert [g["held_by"] for g in run.json()["groups"] if g["group_id"] == s.group] == [[s.offsets_tid]]
    table = s.cli("pending-offsets")
    assert s.group in table.stdout and s.offsets_tid in table.stdout, table

    async def through_the_async_admin() -> tuple[dict[str, list[TopicAndPartition]], TopicAndPartition]:
        async with AsyncTransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
            return await admin.pending_offset_groups(), await admin.consumer_offsets_partition(s.group)

    pending, offsets_tp = asyncio.run(through_the_async_admin())
    assert pending[s.group] == [TopicAndPartition(s.topic, 0)]
    with TransactionAdmin({"bootstrap.servers": s.bootstrap}) as sync_admin:
        holder = sync_admin.describe_transaction(s.offsets_tid)
        assert holder is not None and offsets_tp in holder.description.partitions  # what the broker chose

    exported = s.cli("stats", "--otel", "--watch", "0.2", "--count", "1")  # the console exporter: JSON on stdout
    assert exported.returncode == 0, exported
    for gauge in ("partitions.held_back", "records.held_back", "transaction.oldest_open.age",
                  "consumer_groups.pending_offsets"):
        assert f'"kafka2pc.cluster.{gauge}"' in exported.stdout, exported
    assert f'"kafka2pc.prefix": "k2pc-spark-{s.u}"' in exported.stdout, exported

    watched = s.cli("in-doubt", "--db-url", s.db_url, "--watch", "0.2", "--count", "2", "-o", "json")
    assert watched.returncode == 0, watched
    docs = [json.loads(line) for line in watched.stdout.strip().splitlines()]
    assert len(docs) == 2 and all(d["entries"][0]["decision"] == "commit" for d in docs), watched


def test_abort_policy_refuses_what_the_database_committed_and_aborts_the_rest(situations: Situations) -> None:
    """The operator's policy, then ``recover``; after them ``stats`` shows nothing of this module open or held back."""
    s = situations
    db = ["--db-url", s.db_url, "--lease-table", "kafka_writer_lease"]
    missing_db = s.cli("find-hanging", "--older-than", "0s", "--abort")
    assert missing_db.returncode == ExitCode.USAGE and "--db-url" in missing_db.stderr, missing_db

    dry = s.cli("find-hanging", "--older-than", "0s", "--abort", *db, "-o", "json")
    assert dry.returncode == 0, dry
    s.assert_shape(dry.json(), "stuck")
    assert dry.json()["dry_run"] is True
    actions = {e["transactional_id"]: e for e in dry.json()["transactions"] if e["transactional_id"] in s.mine}
    assert set(actions) == s.mine
    assert actions[s.committed_tid]["action"] == "refuse" and actions[s.committed_tid]["heuristic_if_aborted"]
    assert {tid for tid, e in actions.items() if e["action"] == "would-abort"} == s.mine - {s.committed_tid}
    audit = [line for line in dry.stderr.splitlines() if line.startswith("audit ")]
    assert len(audit) == len(dry.json()["transactions"])  # one line per decision
    with TransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
        assert all(admin.describe_transaction(tid).state == "Ongoing" for tid in s.mine)  # type: ignore[union-attr]

    done = s.cli("find-hanging", "--older-than", "0s", "--abort", "--yes", *db)
    assert done.returncode == ExitCode.FAILURE, done  # one was refused
    assert "REFUSE (HEURISTIC if aborted)" in done.stdout and "kafka2pc recover" in done.stdout, done
    assert sum(line.startswith("audit ") and " aborted " in line for line in done.stderr.splitlines()) >= 5
    with TransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
        states = {tid: admin.describe_transaction(tid).state for tid in s.mine}  # type: ignore[union-attr]
        assert states.pop(s.committed_tid) == "Ongoing"
        assert set(states.values()) <= {"PrepareAbort", "CompleteAbort", "Empty"}, states  # Empty: aborted, fenced
        pending = s.cli("pending-offsets", "-o", "json")
        assert all(g["group_id"] != s.group for g in pending.json()["groups"]), pending

        recovered = s.cli("recover", "--db-url", s.db_url, "-o", "json")
        assert recovered.returncode == 0, recovered
        [entry] = recovered.json()["entries"]
        assert (entry["transactional_id"], entry["decision"], entry["heuristic"]) == (s.committed_tid, "commit", False)
        for partition in (0, 1):
            lag = admin.partition_lag(TopicAndPartition(s.topic, partition))
            assert lag.last_stable_offset == lag.high_watermark  # nothing left open
    committed = s.prepared[s.committed_tid]
    values = sorted((r.value or b"").decode() for r in drain(s.bootstrap, s.topic))
    assert values == sorted(f"{s.committed_tid}-t0-r{i}" for i in range(len(committed.records)))

    after = s.cli("stats", "-o", "json")
    assert after.returncode == 0, after
    s.assert_shape(after.json(), "stats")
    assert not [p for p in after.json()["partitions"] if p["topic"] == s.topic], after
