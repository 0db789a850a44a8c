"""describe-producers, find-hanging and abort (as kafka-transactions.sh), against the real broker.

The open transaction is left by a producer process killed with SIGKILL after
preparing, with the default (long) transaction timeout: the partition holds it
open, and so does its coordinator.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from kafka2pc.cli._errors import ExitCode

from kafka2pc import TopicAndPartition
from kafka2pc._control import ControlPlane
from kafka2pc._hanging import judge
from kafka2pc._types import ProducerState, TransactionDescription
from kafka2pc.testing import drain


def test_describe_find_and_abort_an_open_transaction_of_a_killed_producer(
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    killed_producer: Callable[..., Any],
    kafka_cli: Callable[..., Any],
    documented_shape: Callable[[Any, str], None],
    kafka_judge: Callable[..., list[dict[str, str]]],
) -> None:
    topic = topic_factory(partitions=1)
    tid = f"cli-hanging-{uuid.uuid4().hex[:8]}"
    killed_producer(topic, 1, ("prepared", tid, 3))

    producers = kafka_cli("describe-producers", "--topic", topic, "--partition", "0", "-o", "json")
    assert producers.returncode == 0, producers
    documented_shape(producers.json(), "producers")
    [producer] = producers.json()["producers"]
    assert producer["current_transaction_start_offset"] == 0
    table = kafka_cli("describe-producers", "--topic", topic, "--partition", "0")
    assert table.returncode == 0 and str(producer["producer_id"]) in table.stdout, table

    # Younger than the default 15 minutes: not even a candidate.
    default = kafka_cli("find-hanging", "--topic", topic, "-o", "json")
    assert default.returncode == 0 and default.json()["transactions"] == [], default
    documented_shape(default.json(), "hanging")
    # Any age: a candidate, but its coordinator tracks it, so it is not hanging...
    strict = kafka_cli("find-hanging", "--topic", topic, "--max-transaction-timeout", "0", "-o", "json")
    assert strict.returncode == 0 and strict.json()["transactions"] == [], strict
    assert kafka_judge("find-hanging", "--topic", topic, "--max-transaction-timeout", "0") == []  # Kafka agrees
    # ... which --all-open shows, per topic and per broker.
    for scope in (["--topic", topic, "--partition", "0"], ["--broker-id", "1"]):
        shown = kafka_cli("find-hanging", *scope, "--max-transaction-timeout", "0s", "--all-open", "-o", "json")
        assert shown.returncode == 0, shown
        documented_shape(shown.json(), "hanging")
        mine = [t for t in shown.json()["transactions"] if t["topic"] == topic]
        assert len(mine) == 1, shown
        assert mine[0]["transactional_id"] == tid and mine[0]["coordinator_state"] == "Ongoing"
        assert mine[0]["hanging"] is False and mine[0]["producer_id"] == producer["producer_id"]
    text = kafka_cli("find-hanging", "--topic", topic, "--max-transaction-timeout", "0", "--all-open")
    assert text.returncode == 0 and tid in text.stdout and "no" in text.stdout, text

    # abort refuses a transaction its coordinator still tracks (a prepared 2PC one is settled by complete).
    refused = kafka_cli("abort", "--topic", topic, "--partition", "0", "--start-offset", "0", "--yes")
    assert refused.returncode == ExitCode.FAILURE and "not hanging" in refused.stderr and tid in refused.stderr
    missing = kafka_cli("abort", "--topic", topic, "--partition", "0", "--start-offset", "1", "--yes")
    assert missing.returncode == ExitCode.NOT_FOUND, missing

    with ControlPlane({"bootstrap.servers": kafka_bootstrap}) as ctrl:
        tp = TopicAndPartition(topic, 0)
        _, lso, hw = ctrl.partition_offsets(tp)
        assert (lso, hw) == (0, 3)  # the open transaction pins the last stable offset
        forced = kafka_cli(
            "abort", "--topic", topic, "--partition", "0", "--producer-id", str(producer["producer_id"]),
            "--producer-epoch", str(producer["producer_epoch"]), "--force", "--yes",
        )
        assert forced.returncode == 0 and "last stable offset now 4" in forced.stdout, forced
        _, lso, hw = ctrl.partition_offsets(tp)
        assert lso == hw == 4  # the abort marker is offset 3
        assert not [p for p in ctrl.describe_producers(tp) if p.current_txn_start_offset >= 0]
    assert drain(kafka_bootstrap, topic) == []  # the records are aborted for read_committed readers
    cleanup = kafka_cli("force-terminate", "--transactional-id", tid, "--yes")
    assert cleanup.returncode == 0, cleanup


def test_find_hanging_and_abort_agree_with_kafkas_transactions_command(
    kafka_bootstrap: str, topic_factory: Callable[..., str], kafka_cli: Callable[..., Any],
    kafka_judge: Callable[..., list[dict[str, str]]], cli_harness: Any,
) -> None:
    """A transaction open on a partition that no coordinator knows: kafka2pc and Kafka's own tool both find it."""
    topic = topic_factory(partitions=2)
    hanging = cli_harness.make_hanging_transaction(kafka_bootstrap, topic, 1, 3)
    assert cli_harness.measured_offsets(kafka_bootstrap, topic, 1) == (0, 3)  # plain confluent-kafka

    found = kafka_cli("find-hanging", "--topic", topic, "-o", "json")
    assert found.returncode == 0, found
    [row] = found.json()["transactions"]
    assert (row["partition"], row["producer_id"], row["current_transaction_start_offset"], row["hanging"],
            row["transactional_id"]) == (1, hanging.producer_id, 0, True, None)
    judged = kafka_judge("find-hanging", "--topic", topic)
    assert [(r["Partition"], r["ProducerId"], r["StartOffset"]) for r in judged] == [
        ("1", str(hanging.producer_id), "0")]

    aborted = kafka_cli("abort", "--topic", topic, "--partition", "1", "--start-offset", "0", "--yes")
    assert aborted.returncode == 0 and "last stable offset now 4 (high watermark 4)" in aborted.stdout, aborted
    assert cli_harness.measured_offsets(kafka_bootstrap, topic, 1) == (4, 4)  # 3 records and the abort marker
    assert kafka_cli("find-hanging", "--topic", topic, "-o", "json").json()["transactions"] == []
    assert kafka_judge("find-hanging", "--topic", topic, "--max-transaction-timeout", "0") == []


def test_find_hanging_needs_a_scope(kafka_cli: Callable[..., Any]) -> None:
    run = kafka_cli("find-hanging", "-o", "json")
    assert run.returncode == ExitCode.USAGE
    assert run.json()["error"]["name"] == "USAGE"
    both = kafka_cli("find-hanging", "--topic", "t", "--broker-id", "1")
    assert both.returncode == ExitCode.USAGE
    unknown = kafka_cli("find-hanging", "--topic", f"no-such-{uuid.uuid4().hex[:6]}")
    assert unknown.returncode == ExitCode.USAGE and "unknown topic" in unknown.stderr, unknown


# -- the judgement, unit by unit (no broker) ---------------------------------------------

TP = TopicAndPartition("t", 0)
PRODUCER = ProducerState(producer_id=7, producer_epoch=0, last_sequence=2, last_timestamp_ms=0,
                         coordinator_epoch=0, current_txn_start_offset=10)


def _desc(state: str, producer_id: int = 7, partitions: tuple[TopicAndPartition, ...] = (TP,)) -> TransactionDescription:
    return TransactionDescription("tx", state, producer_id, 0, 60_000, 1, partitions, 1)


def test_judge_hanging_without_a_transactional_id() -> None:
    hanging, reason, tid, _ = judge(TP, PRODUCER, [], {})
    assert hanging and tid is None and "no coordinator" in reason


def test_judge_not_hanging_while_the_coordinator_has_it_open_with_the_partition() -> None:
    assert judge(TP, PRODUCER, ["tx"], {"tx": _desc("Ongoing")})[0] is False
    assert judge(TP, PRODUCER, ["tx"], {"tx": _desc("PrepareCommit")})[0] is False


def test_judge_hanging_when_the_coordinator_ended_it_or_lacks_the_partition_or_moved_on() -> None:
    assert judge(TP, PRODUCER, ["tx"], {"tx": _desc("CompleteAbort")})[0] is True
    assert judge(TP, PRODUCER, ["tx"], {"tx": _desc("Ongoing", partitions=(TopicAndPartition("t", 1),))})[0] is True
    assert judge(TP, PRODUCER, ["tx"], {"tx": _desc("Ongoing", producer_id=8)})[0] is True
    assert judge(TP, PRODUCER, ["tx"], {"tx": None})[0] is True
