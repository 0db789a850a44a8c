"""docs/runbook.md, walked through step by step against a broker of its own.

The commands are read from the page (each ``<!-- runbook-transcript -->``
block: ``$ kafka2pc ...`` lines, each followed by its output) and run in page
order, as an operator would, with ``KAFKA_BOOTSTRAP_SERVERS`` set and the
state database in the working directory.  Each command's output must be the
one on the page, but for what differs from run to run (times and ages).
``KAFKA2PC_UPDATE_RUNBOOK=1`` writes this run's output onto the page instead.

The situations (on a one-node cluster started fresh for this module, so that
no other test's transactions show in ``stats``):

* "Consumers stopped advancing": a pool's two ids killed with prepared
  transactions on ``events`` (the database committed ``orders-0``'s; the
  row of ``orders-1`` holds no prepared state), an application's
  ``reports-0`` killed mid-transaction (no state row), and a hanging
  transaction on ``payments-0`` that no coordinator knows;
* "A consumer group does not resume": the group ``billing``, whose offsets
  ``billing-offsets-0`` sent in a transaction that stays open.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, Producer
from confluent_kafka import TopicPartition as KafkaTopicPartition

from kafka2pc.testing import create_topic
from kafka2pc.testing.broker import LocalKafka, port_base

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "runbook.md"
MARKER = "<!-- runbook-transcript -->"
BLOCK = re.compile(re.escape(MARKER) + r"\n```text\n(.*?)\n```", re.DOTALL)
SECOND_SECTION = "## A consumer group does not resume"
HANGING_PRODUCER_ID = 4242
RUNBOOK_PORT_OFFSET = 600
"""The runbook's broker: its own slot in the port block (the shared brokers use +92, +192, +1092...)."""

_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z?")
_DURATION = re.compile(r"\b(?:\d+ms|\d+s|\d+m\d\ds|\d+h\d\dm\d\ds|\d+d\d\dh\d\dm)\b")


def comparable(output: str) -> list[str]:
    """An output with what differs between runs masked (times, ages) and columns' padding collapsed."""
    return [" ".join(_DURATION.sub("<age>", _TIME.sub("<time>", line)).split()) for line in output.splitlines()]


@dataclass
class Step:
    command: str
    output: str


@dataclass
class Block:
    start: int  # offset of the block's text in the page
    end: int
    section: int  # 0: "Consumers stopped advancing", 1: "A consumer group does not resume"
    steps: list[Step] = field(default_factory=list)


def page_blocks(text: str) -> list[Block]:
    """The transcripts of the runbook, in page order."""
    second = text.index(SECOND_SECTION)
    blocks = []
    for match in BLOCK.finditer(text):
        block = Block(match.start(1), match.end(1), int(match.start() > second))
        for line in match.group(1).splitlines():
            if line.startswith("$ "):
                block.steps.append(Step(line[2:], ""))
            else:
                assert block.steps, f"docs/runbook.md: a runbook transcript starts with output: {line!r}"
                block.steps[-1].output += line + "\n"
        blocks.append(block)
    return blocks


@pytest.fixture(scope="module")
def runbook_kafka() -> Iterator[str]:
    base = port_base() + RUNBOOK_PORT_OFFSET
    kafka = LocalKafka(brokers=1, base_port=base, name=f"kafka2pc-runbook-{base}")
    earlier = kafka._load()
    if earlier is not None:
        earlier.wipe()  # a fresh cluster: no transactions but the runbook's
    kafka.start()
    try:
        yield kafka.bootstrap_servers
    finally:
        kafka.wipe()


def _offsets_in_an_open_transaction(bootstrap: str, tid: str, group: str, offset: KafkaTopicPartition) -> Any:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": tid, "transaction.timeout.ms": 900_000})
    producer.init_transactions(60)
    producer.begin_transaction()
    producer.send_offsets_to_transaction([offset], consumer.consumer_group_metadata(), 60)
    consumer.close()
    return producer


def test_the_runbook_as_the_page_shows_it(
    runbook_kafka: str, cli_harness: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    bootstrap = runbook_kafka
    text = PAGE.read_text()
    blocks = page_blocks(text)
    assert len(blocks) >= 6 and {b.section for b in blocks} == {0, 1}, "docs/runbook.md: the runbook's transcripts"

    procs: list[subprocess.Popen[bytes]] = []
    request.addfinalizer(lambda: cli_harness.reap(procs))
    create_topic(bootstrap, "events", partitions=2)
    create_topic(bootstrap, "payments", partitions=1)
    prepared = cli_harness.spawn_killed(
        bootstrap, procs, "events", 2,
        ("prepared", "orders-0", 1), ("prepared", "orders-1", 2), ("prepared", "reports-0", 1),
    )
    cli_harness.make_hanging_transaction(bootstrap, "payments", 0, 3, producer_id=HANGING_PRODUCER_ID)
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'state.db'}")
    with engine.begin() as conn:
        conn.execute(sa.text(
            "CREATE TABLE kafka_transaction_state (transactional_id VARCHAR(255) PRIMARY KEY, "
            "prepared_txn_state VARCHAR(255), updated_at TIMESTAMP)"))
        conn.execute(sa.text("INSERT INTO kafka_transaction_state VALUES "
                             "('orders-0', :s, '2026-11-27 10:00:00'), ('orders-1', NULL, '2026-11-27 10:00:00')"),
                     {"s": prepared["orders-0"].states[0]})
    engine.dispose()
    time.sleep(1.5)  # the runbook's "stuck --older-than 1s": every transaction above is older
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap}
    producers = []

    ran: list[tuple[Block, list[str]]] = []
    for block in blocks:
        if block.section == 1 and not producers:
            producers.append(_offsets_in_an_open_transaction(
                bootstrap, "billing-offsets-0", "billing", KafkaTopicPartition("events", 0, 1)))
        outputs = []
        for step in block.steps:
            args = shlex.split(step.command)
            assert args[0] == "kafka2pc", step.command
            run = subprocess.run([cli_harness.console_script(), *args[1:]], capture_output=True, text=True,
                                 cwd=tmp_path, env=env, timeout=120, stdin=subprocess.DEVNULL)
            output = run.stdout + (f"[exit code {run.returncode}]\n" if run.returncode else "")
            assert "Traceback" not in run.stderr, run.stderr
            outputs.append(output)
        ran.append((block, outputs))

    if os.environ.get("KAFKA2PC_UPDATE_RUNBOOK"):
        for block, outputs in reversed(ran):
            transcript = "".join(f"$ {step.command}\n{out}" for step, out in zip(block.steps, outputs, strict=True))
            text = text[:block.start] + transcript.rstrip("\n") + text[block.end:]
        PAGE.write_text(text)
        return
    for block, outputs in ran:
        for step, output in zip(block.steps, outputs, strict=True):
            assert comparable(output) == comparable(step.output), (
                f"docs/runbook.md: `{step.command}` printed\n{output}\nwhere the page shows\n{step.output}"
                "(KAFKA2PC_UPDATE_RUNBOOK=1 writes this run's output onto the page)")
    del producers
