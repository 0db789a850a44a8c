"""Every transaction shape through the dual-write recipe: N committed, N+1 prepared, ``kill -9``, recover.

A child process (this file run as a script) reads an input topic with a
consumer and runs three :class:`DualWriter` transactions on SQLite:

0. records *and* consumer offsets (``tx.send_consumer_offsets``) to position 3;
1. transaction N of one shape;
2. transaction N+1 of another shape, killed with SIGKILL once its Kafka side is
   prepared and its state written, before the database commits.

Shapes: ``records`` (2 records, no offsets), ``offsets`` (only
``tx.send_consumer_offsets``: the consume -> database pattern) and ``empty``
(database rows only, nothing sent to Kafka).  A new :class:`DualWriter` then
runs ``recover()``; N+1 must be aborted and N's effects must stay, as seen by
a ``read_committed`` consumer, the group's committed offset and the database.
Only the recipe's public API is used.  On the default broker line: what
differs between broker lines is the coordinator, and the core's shape tests
(``tests/core/test_shapes.py``) run the same shapes on every line of CI's matrix.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from harness.consumers import assign_at_committed
from harness.procs import REPO, child_env
from kafka2pc.recipes.dual_write import DualWriter, Step, define_state_table

from kafka2pc import Decision, TransactionOutcome
from kafka2pc.testing import create_topic, drain, end_offsets

FIRST, N_POSITION, NEXT_POSITION = 3, 5, 10
PAIRS = [
    ("records", "records"),
    ("records", "offsets"),
    ("offsets", "records"),
    ("offsets", "offsets"),
    ("empty", "empty"),
    ("empty", "offsets"),
    ("offsets", "empty"),
]


def _tables(metadata: sa.MetaData) -> tuple[sa.Table, sa.Table]:
    work = sa.Table(
        "shape_work", metadata,
        sa.Column("txn", sa.Integer, primary_key=True),
        sa.Column("shape", sa.String(20), nullable=False),
        sa.Column("position", sa.Integer, nullable=True),
    )
    return define_state_table(metadata), work


def child(bootstrap: str, source: str, sink: str, tid: str, group: str, db_url: str, shapes: list[str]) -> None:
    """Run transactions 0..2 (shapes[0] is N, shapes[1] is N+1); die in N+1 at STATE_STORED."""
    from confluent_kafka import Consumer, TopicPartition

    engine = sa.create_engine(db_url)
    metadata = sa.MetaData()
    states, work = _tables(metadata)
    metadata.create_all(engine)
    current = {"txn": -1}

    def hook(step: Step) -> None:
        if current["txn"] == 2 and step is Step.STATE_STORED:
            os.kill(os.getpid(), signal.SIGKILL)

    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
        "auto.offset.reset": "earliest", "isolation.level": "read_committed",
    })
    assign_at_committed(consumer, [TopicPartition(source, 0)])

    def consume_to(position: int) -> None:
        while consumer.position([TopicPartition(source, 0)])[0].offset < position:
            consumer.consume(num_messages=position - max(consumer.position([TopicPartition(source, 0)])[0].offset, 0),
                             timeout=1.0)
        assert consumer.position([TopicPartition(source, 0)])[0].offset == position

    writer = DualWriter(engine, {"bootstrap.servers": bootstrap, "transactional.id": tid}, state_table=states,
                        on_step=hook)
    writer.recover()
    plan = [("first", FIRST), (shapes[0], N_POSITION), (shapes[1], NEXT_POSITION)]
    for txn, (shape, position) in enumerate(plan):
        current["txn"] = txn
        with engine.connect() as conn, writer.transaction(conn) as tx:
            sends_offsets = shape in ("first", "offsets")
            if sends_offsets:
                consume_to(position)
            conn.execute(work.insert().values(txn=txn, shape=shape, position=position if sends_offsets else None))
            if shape in ("first", "records"):
                for i in range(1 if shape == "first" else 2):
                    tx.produce(sink, value=f"{txn}-{i}".encode())
            if sends_offsets:
                tx.send_consumer_offsets(consumer)
        print(f"COMMITTED {txn}", flush=True)
    raise SystemExit("transaction N+1 was not killed")


def _committed_position(bootstrap: str, group: str, topic: str) -> int:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        (tp,) = consumer.committed([TopicPartition(topic, 0)], timeout=30)
    finally:
        consumer.close()
    return int(tp.offset)


@pytest.mark.parametrize(("shape_n", "shape_next"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_recover_aborts_prepared_n_plus_1_and_keeps_n(
    kafka_bootstrap: str, tmp_path: Path, shape_n: str, shape_next: str
) -> None:
    from confluent_kafka import Producer

    bootstrap = kafka_bootstrap
    source, sink = create_topic(bootstrap), create_topic(bootstrap)
    feeder = Producer({"bootstrap.servers": bootstrap})
    for i in range(20):
        feeder.produce(source, value=f"in-{i}".encode())
    assert feeder.flush(30) == 0
    tid, group = f"k2pc-dw-shape-{uuid.uuid4().hex[:8]}", f"k2pc-dw-shape-g-{uuid.uuid4().hex[:8]}"
    db_url = f"sqlite:///{tmp_path / 'app.db'}"
    log = tmp_path / "child.log"
    with open(log, "w") as err:
        proc = subprocess.run(
            [sys.executable, __file__, bootstrap, source, sink, tid, group, db_url, shape_n, shape_next],
            stdout=subprocess.PIPE, stderr=err, text=True, timeout=180, cwd=REPO,
            env=child_env(),
        )
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, log.read_text()[-3000:])
    assert proc.stdout.split() == ["COMMITTED", "0", "COMMITTED", "1"], proc.stdout

    engine = sa.create_engine(db_url)
    metadata = sa.MetaData()
    states, work = _tables(metadata)
    with DualWriter(engine, {"bootstrap.servers": bootstrap, "transactional.id": tid}, state_table=states) as writer:
        result = writer.recover()
        settlement = result.settlement
        assert settlement is not None and not result.heuristic
        expected = Decision.NOTHING if shape_next == "empty" else Decision.ABORT
        assert settlement.plan.decision is expected, settlement.plan
        assert settlement.outcome is (
            TransactionOutcome.NONE if shape_n == "empty" else TransactionOutcome.COMMITTED
        ), settlement

    with engine.connect() as conn:
        rows = conn.execute(sa.select(work.c.txn, work.c.shape, work.c.position).order_by(work.c.txn)).all()
    n_position = N_POSITION if shape_n == "offsets" else None
    assert [tuple(r) for r in rows] == [(0, "first", FIRST), (1, shape_n, n_position)]
    visible = sorted(r.value.decode() for r in drain(bootstrap, sink, "read_committed") if r.value)
    assert visible == ["0-0"] + (["1-0", "1-1"] if shape_n == "records" else [])
    assert _committed_position(bootstrap, group, source) == (N_POSITION if shape_n == "offsets" else FIRST)
    assert end_offsets(bootstrap, sink, "read_committed") == end_offsets(bootstrap, sink, "read_uncommitted")


if __name__ == "__main__":
    bootstrap_, source_, sink_, tid_, group_, db_url_, *shapes_ = sys.argv[1:]
    child(bootstrap_, source_, sink_, tid_, group_, db_url_, shapes_)
