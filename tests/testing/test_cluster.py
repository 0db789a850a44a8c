"""Three-node KRaft cluster: a prepared transaction survives the loss of its coordinator; combined faults.

The combined faults kill the transaction coordinator's broker (SIGKILL) while the dual write is at one of
its steps, on the real 3-node cluster: during the database COMMIT of a writer's transaction (the writer goes
on), during a recovery (after its claim, before it settles Kafka), and during a writer pool's settlement of
a killed instance's orphans. Then: every acknowledged write is kept (``harness.acks``), rows == records,
and nothing is left open, by kafka2pc's view (last stable offsets) and by Kafka's own
``TransactionsCommand`` (``harness.kafka_judge``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from harness.acks import AckLog
from harness.crash_matrix import prepare_db, recover_here
from harness.dw_crash import Zygote, check_consistency
from harness.kafka_judge import assert_nothing_open
from harness.pool import pool_engine
from harness.procs import TESTS, child_env

from kafka2pc import PreparedTxnState, TransactionAdmin
from kafka2pc.testing import create_topic, drain, end_offsets
from kafka2pc.testing.broker import LocalKafka

POOL_WORKER = TESTS / "recipes" / "pool" / "_pool_worker.py"

CHILD = textwrap.dedent(
    """
    import sys, time
    from kafka2pc import TwoPhaseCommitProducer
    bootstrap, tid, topic = sys.argv[1:4]
    p = TwoPhaseCommitProducer({"bootstrap.servers": bootstrap, "transactional.id": tid})
    p.init_transactions()
    p.begin_transaction()
    for i in range(6):
        p.produce(topic, value=b"rec-%d" % i, partition=i % 3)
    state = p.prepare_transaction()
    print("PREPARED", state, flush=True)
    time.sleep(600)
    """
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalKafka]:
    kafka = LocalKafka.up(brokers=3)
    yield kafka
    kafka.wipe()  # throwaway cluster: no need for a clean shutdown


def test_prepared_transaction_completes_after_coordinator_is_killed(cluster: LocalKafka) -> None:
    bootstrap = cluster.bootstrap_servers
    topic = create_topic(bootstrap, partitions=3, replication_factor=3)
    tid = f"failover-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, bootstrap, tid, topic], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline().split()
        assert line[0] == "PREPARED", line
        state = PreparedTxnState(line[1])
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()

    admin = TransactionAdmin({"bootstrap.servers": bootstrap}, request_timeout_s=20)
    try:
        info = admin.describe_transaction(tid)
        assert info is not None and info.state == "Ongoing"
        coordinator = info.description.coordinator_id
        cluster.stop_node(coordinator, kill=True)
        try:
            settlement = admin.complete_transaction(tid, state)
        finally:
            cluster.start_node(coordinator)
    finally:
        admin.close()

    assert settlement.outcome.value == "committed"
    values = sorted(r.value for r in drain(bootstrap, topic, "read_committed", timeout=60))
    assert values == sorted(b"rec-%d" % i for i in range(6))
    assert end_offsets(bootstrap, topic, "read_committed") == end_offsets(bootstrap, topic, "read_uncommitted")


def _leader_of(admin: Any, topic: str, timeout: float = 30.0) -> int:
    """The leader of ``topic``'s partition 0, once the broker answering Metadata lists it (a broker can
    answer for a topic just created before it has that partition)."""
    deadline = time.monotonic() + timeout
    while True:
        partitions = admin.list_topics(topic, timeout=20).topics[topic].partitions
        if 0 in partitions and partitions[0].leader >= 0:
            return int(partitions[0].leader)
        assert time.monotonic() < deadline, f"{topic}-0 has no leader in the metadata after {timeout} s"
        time.sleep(0.1)


def test_a_cached_partition_leader_that_died_is_looked_up_again(cluster: LocalKafka) -> None:
    """The control plane keeps a partition's leader; when that broker dies it asks Metadata again and goes on."""
    from confluent_kafka.admin import AdminClient

    from kafka2pc import TopicAndPartition

    bootstrap = cluster.bootstrap_servers
    topic = create_topic(bootstrap, partitions=1, replication_factor=3)
    tp = TopicAndPartition(topic, 0)
    admin = TransactionAdmin({"bootstrap.servers": bootstrap}, request_timeout_s=20)
    try:
        assert admin.describe_producers(tp) == []
        assert admin.describe_producers(tp) == []
        metadata = admin.control_plane.requests_sent["Metadata"]
        leader = _leader_of(AdminClient({"bootstrap.servers": bootstrap}), topic)
        cluster.stop_node(leader, kill=True)
        try:
            assert admin.describe_producers(tp, timeout=60) == []  # the new leader answers
            assert admin.control_plane.requests_sent["Metadata"] > metadata
        finally:
            cluster.start_node(leader)
    finally:
        admin.close()


def _wait_fenced(cluster: LocalKafka, node: int, timeout: float) -> float:
    """Wait until the cluster's metadata lists only the other brokers (the controller fenced ``node``)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from kafka2pc._logging import with_librdkafka_logger

    admin = AdminClient(with_librdkafka_logger({"bootstrap.servers": cluster.bootstrap_servers}))
    others = sorted(n.node_id for n in cluster.nodes if n.node_id != node)
    started = time.monotonic()
    listed: object = None
    while time.monotonic() - started < timeout:
        try:
            listed = sorted(admin.list_topics(timeout=5).brokers)
        except KafkaException as exc:  # a metadata request that went to the dead broker; ask again
            listed = exc
        if listed == others:
            return time.monotonic() - started
        time.sleep(0.5)
    raise AssertionError(f"broker {node} still listed {timeout:.0f}s after its kill: {listed}")


@pytest.mark.parametrize("brokers", [
    "one",  # the broker killed is drawn from the run's seed: each run kills another
    pytest.param("each", marks=pytest.mark.campaign),  # the three in turn: about 50 s
])
def test_new_producers_start_while_any_one_broker_is_dead(cluster: LocalKafka, brokers: str, seed: int) -> None:
    """A broker is killed (each in turn, or one the run's seed draws); once Kafka has fenced it, new
    producers start and commit within their bounds: each reads the brokers' ``transaction.max.timeout.ms``
    (DescribeConfigs) from a live broker, although the dead one is still in ``bootstrap.servers`` and
    among the controllers.

    Until Kafka fences a killed broker (``broker.session.timeout.ms``, 9 s; longer on a loaded machine)
    the transactional ids it coordinated have no coordinator, and ``init_transactions`` for them ends at
    its bound with ``RetriableError``; test_prepared_transaction_completes_after_coordinator_is_killed
    covers that failover."""
    from kafka2pc import TwoPhaseCommitProducer

    bootstrap = cluster.bootstrap_servers
    topic = create_topic(bootstrap, partitions=3, replication_factor=3)
    series = uuid.uuid4().hex[:8]
    nodes = (1, 2, 3) if brokers == "each" else (1 + seed % 3,)
    for node in nodes:
        cluster.stop_node(node, kill=True)
        try:
            fenced_after = _wait_fenced(cluster, node, timeout=120)
            print(f"\nbroker {node} dead: fenced after {fenced_after:.1f}s")
            for i in range(2):
                tid = f"start-{series}-{node}-{i}"
                started = time.monotonic()
                with TwoPhaseCommitProducer({"bootstrap.servers": bootstrap, "transactional.id": tid}) as p:
                    p.init_transactions(30)
                    p.begin_transaction()
                    p.produce(topic, value=f"{node}-{i}".encode())
                    p.commit_transaction(30)
                took = time.monotonic() - started
                print(f"broker {node} dead: producer {i} started and committed in {took:.1f}s")
                assert took <= 30, took  # no call waited out its bound on the dead broker
        finally:
            cluster.start_node(node, wait=False)
            cluster.wait_ready(timeout=300)  # a JVM restarted on a loaded machine
    values = sorted(r.value for r in drain(bootstrap, topic, "read_committed", timeout=60))
    assert values == sorted(f"{n}-{i}".encode() for n in nodes for i in range(2))
    assert end_offsets(bootstrap, topic, "read_committed") == end_offsets(bootstrap, topic, "read_uncommitted")


# -- combined faults: the coordinator's broker dies at a step of the dual write ----------------------------
COMBINED_TIMEOUT_S = 240.0
"""Bound on one child of the combined-fault tests: its Kafka calls wait for Kafka to move the coordinator."""


@dataclass
class _Series:
    """One transactional id's dual writes on the cluster: its database, topic, acknowledged-write log."""

    cluster: LocalKafka
    url: str
    tid: str
    topic: str
    series: str
    workdir: Path

    @property
    def acks(self) -> AckLog:
        return AckLog(self.workdir / f"{self.series}.acks")

    @property
    def results(self) -> Path:
        return self.workdir / f"{self.series}.jsonl"

    def job(self, **extra: Any) -> dict[str, Any]:
        return {"db_url": self.url, "bootstrap": self.cluster.bootstrap_servers, "tid": self.tid, "topic": self.topic,
                "series": self.series, "results": str(self.results), "ack_log": str(self.acks.path),
                "transactions": 2, "records": 2, **extra}

    def entries(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.results.read_text().splitlines()] if self.results.exists() else []

    def finish(self, tids: list[str]) -> tuple[int, int]:
        """A last recovery (sync writer, this process), then the invariants; ``(rows, acknowledged)``."""
        engine = sa.create_engine(self.url, poolclass=sa.pool.NullPool)
        try:
            if tids == [self.tid]:
                recover_here(engine, self.cluster.bootstrap_servers, self.tid)
            rows, records, problems = check_consistency(engine, self.cluster.bootstrap_servers, self.topic,
                                                        self.series, self.acks)
        finally:
            engine.dispose()
        assert not problems, problems
        assert rows == records
        assert_nothing_open(self.cluster.bootstrap_servers, tids, topics=[self.topic])
        return rows, len(self.acks.ids())


def _series(cluster: LocalKafka, url: str, tmp_path: Path, name: str) -> _Series:
    series = f"cf-{name}-{uuid.uuid4().hex[:6]}"
    topic = create_topic(cluster.bootstrap_servers, partitions=2, replication_factor=3)
    prepare_db(url).dispose()
    return _Series(cluster, url, f"dw-{series}", topic, series, tmp_path)


def _coordinator(cluster: LocalKafka, tid: str) -> tuple[int, int]:
    """``(node id, pid)`` of the broker coordinating ``tid`` (which must have begun there)."""
    with TransactionAdmin({"bootstrap.servers": cluster.bootstrap_servers}, request_timeout_s=20) as admin:
        info = admin.describe_transaction(tid, timeout=60)
    assert info is not None, f"{tid} is unknown to the coordinators"
    node = int(info.description.coordinator_id)
    return node, next(n.pid for n in cluster.nodes if n.node_id == node)


def _restart(cluster: LocalKafka, node: int) -> None:
    """Bring the killed node back (it was killed by a child: reap it through stop_node) and wait for all three."""
    cluster.stop_node(node, kill=True)
    cluster.start_node(node, wait=False)
    cluster.wait_ready(timeout=300)  # a JVM restarted on a loaded machine


def test_coordinator_killed_during_the_database_commit(cluster: LocalKafka, tmp_path: Path) -> None:
    """A writer's second transaction: its coordinator's broker dies as the database COMMIT goes out; the
    writer goes on (its Kafka commit waits for the new coordinator, or fails and leaves it in doubt)."""
    s = _series(cluster, f"sqlite:///{tmp_path / 'commit.db'}", tmp_path, "commit")
    zygote = Zygote(tmp_path / "commit-zygote.log")
    try:
        assert zygote.run(s.job(run=0, transactions=1)) == 0  # the id begins at its coordinator
        node, pid = _coordinator(cluster, s.tid)
        try:
            code = zygote.run(s.job(run=1, transactions=3, crash_txn=1, kill_broker_at="db_committing",
                                    broker_pid=pid, record_errors=True), timeout=COMBINED_TIMEOUT_S)
        finally:
            _restart(cluster, node)
    finally:
        zygote.close()
    entries = s.entries()
    assert code == 0, entries
    assert {"run": 1, "broker_killed_at": "db_committing"} in entries
    outcome = next(e for e in entries if e.get("run") == 1 and "error" in e)
    rows, acked = s.finish([s.tid])
    print(f"\ncoordinator (broker {node}) killed during the database COMMIT: the writer saw {outcome['error']}; "
          f"{rows} rows = records, {acked} acknowledged ids kept")
    # The first child's transaction, and the second's until the fault, were acknowledged.
    assert acked >= 2 + 2


def test_coordinator_killed_during_recovery(cluster: LocalKafka, tmp_path: Path) -> None:
    """A writer killed past its database COMMIT (Kafka prepared); the next one's coordinator dies during its
    recovery (after the claim, before Kafka is settled): the prepared transaction is committed all the same."""
    s = _series(cluster, f"sqlite:///{tmp_path / 'recovery.db'}", tmp_path, "recovery")
    zygote = Zygote(tmp_path / "recovery-zygote.log")
    try:
        assert zygote.run(s.job(run=0, point="db_committed", crash_txn=1)) == -9
        node, pid = _coordinator(cluster, s.tid)
        try:
            code = zygote.run(s.job(run=1, kill_broker_at="recovery_claimed", broker_pid=pid, record_errors=True),
                              timeout=COMBINED_TIMEOUT_S)
        finally:
            _restart(cluster, node)
    finally:
        zygote.close()
    entries = s.entries()
    assert code == 0, entries
    assert {"run": 1, "broker_killed_at": "recovery_claimed"} in entries
    recovered = next(e for e in entries if e.get("run") == 1 and ("decision" in e or "recover_error" in e))
    rows, acked = s.finish([s.tid])
    print(f"\ncoordinator (broker {node}) killed during recovery: {recovered}; {rows} rows = records, "
          f"{acked} acknowledged ids kept")
    if "decision" in recovered:
        assert recovered["decision"] == "commit", recovered  # the database committed it
        assert rows == 8 and acked == 2 + 4  # run 0's first transaction, run 1's two
    else:  # the recovery failed within its bound; the last one (finish) committed it
        assert rows == 4 and acked == 2


def test_coordinator_killed_during_a_pools_orphan_settlement(
    cluster: LocalKafka, pg_url: str, tmp_path: Path
) -> None:
    """A pool instance killed past a database COMMIT (Kafka prepared) leaves its ids to the others; the
    coordinator of its id in doubt dies while another pool settles them (after the claim)."""
    from kafka2pc.recipes.dual_write import Step, WriterPool, define_lease_table, define_state_table

    s = _series(cluster, pg_url, tmp_path, "pool")
    pool_engine(pg_url).dispose()  # the lease table
    lease_s = 2.0
    job = {"db_url": pg_url, "bootstrap": cluster.bootstrap_servers, "prefix": s.series, "size": 3, "threads": 1,
           "lease_s": lease_s, "topic": s.topic, "series": s.series, "worker": "w0", "results": str(s.results),
           "ack_log": str(s.acks.path), "kill_at": "db_committed", "after": 2}
    proc = subprocess.run([sys.executable, str(POOL_WORKER), json.dumps(job)], env=child_env(), timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    engine = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
    leases = define_lease_table(sa.MetaData())
    with engine.connect() as conn:
        held = list(conn.execute(sa.select(leases.c.transactional_id)
                                 .where(leases.c.pool == s.series, leases.c.owner.is_not(None))).scalars())
    with TransactionAdmin({"bootstrap.servers": cluster.bootstrap_servers}, request_timeout_s=20) as admin:
        in_doubt = [tid for tid in held if (info := admin.describe_transaction(tid)) is not None and info.is_open]
    assert len(in_doubt) == 1, (held, in_doubt)
    node, pid = _coordinator(cluster, in_doubt[0])
    killed: list[float] = []

    def kill_the_coordinator(step: Step) -> None:
        if step is Step.RECOVERY_CLAIMED and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(time.monotonic())

    time.sleep(lease_s + 0.2)  # the killed instance's leases expire (its last renewal was before its death)
    pool = WriterPool(engine, {"bootstrap.servers": cluster.bootstrap_servers}, prefix=s.series, size=3,
                      lease_s=30, start=False, on_step=kill_the_coordinator,
                      state_table=define_state_table(sa.MetaData()))
    settled: dict[str, str] = {}
    errors: list[str] = []
    try:
        deadline = time.monotonic() + COMBINED_TIMEOUT_S
        while set(settled) != set(held):
            assert time.monotonic() < deadline, f"orphans not settled: {settled}, errors {errors}"
            for result in pool.settle_orphans():
                if result.error is not None:
                    errors.append(repr(result.error))
                elif result.settlement is not None:
                    settled[result.transactional_id] = result.settlement.plan.decision.value
    finally:
        try:
            pool.close()
        finally:
            engine.dispose()
            _restart(cluster, node)
    assert killed, "the settlement never reached its claim"
    rows, acked = s.finish(held)
    print(f"\ncoordinator (broker {node}) of {in_doubt[0]} killed during the orphan settlement: decisions "
          f"{settled}, {len(errors)} failed attempts first; {rows} rows = records, {acked} acknowledged ids kept")
    assert settled[in_doubt[0]] == "commit"  # the database committed it
    assert acked >= 2 and rows == acked + 1
