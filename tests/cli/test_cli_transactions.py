"""list / describe / complete / force-terminate against transactions a killed process left prepared.

Cross-checked with Apache Kafka's own ``TransactionsCommand`` (kafka-tools),
verified with ``read_committed`` consumers and with the coordinator (fencing).
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from kafka2pc.cli._errors import ExitCode

from kafka2pc import ProducerFencedError
from kafka2pc._control import ControlPlane
from kafka2pc.testing import drain, end_offsets
from kafka2pc.testing.broker import LocalKafka, fetch_kafka_tools


def transactions_command(local_kafka: LocalKafka | None, bootstrap: str, *args: str) -> list[dict[str, str]]:
    """Run Apache Kafka's TransactionsCommand (the newest kafka-tools release); its tab-separated table as dicts."""
    java = shutil.which("java")
    assert java is not None, "java is needed for Apache Kafka's TransactionsCommand"
    proc = subprocess.run(
        [java, "-cp", f"{fetch_kafka_tools()}/*", "org.apache.kafka.tools.TransactionsCommand",
         "--bootstrap-server", bootstrap, *args],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "\t" in line]
    header = [cell.strip() for cell in lines[0].split("\t")]
    return [dict(zip(header, (cell.strip() for cell in line.split("\t")), strict=False)) for line in lines[1:]]


def test_inspect_complete_and_force_terminate_a_killed_prepared_transaction(
    kafka_bootstrap: str,
    local_kafka: LocalKafka | None,
    topic_factory: Callable[..., str],
    killed_producer: Callable[..., Any],
    kafka_cli: Callable[..., Any],
    run_kafka2pc: Callable[..., Any],
    documented_shape: Callable[[Any, str], None],
) -> None:
    topic = topic_factory(partitions=2)
    suffix = uuid.uuid4().hex[:8]
    doomed, kept = f"cli-doomed-{suffix}", f"cli-kept-{suffix}"
    txns = killed_producer(topic, 2, ("prepared", doomed, 5), ("prepared", kept, 3))
    hw = end_offsets(kafka_bootstrap, topic, "read_uncommitted")
    lso = end_offsets(kafka_bootstrap, topic, "read_committed")
    assert sum(hw.values()) == 8 and sum(lso.values()) == 0  # both transactions open, nothing readable

    # -- list: both open transactions, oldest first, each partition with what it holds back
    listed = kafka_cli("list", "--min-open", "0s", "--output", "json")
    assert listed.returncode == 0, listed
    document = listed.json()
    documented_shape(document, "list")
    ours = [t for t in document["transactions"] if t["transactional_id"] in (doomed, kept)]
    assert [t["transactional_id"] for t in ours] == [doomed, kept]  # doomed started first
    for txn in ours:
        assert txn["state"] == "Ongoing" and txn["open_for_ms"] >= 0
        assert [(p["topic"], p["partition"]) for p in txn["partitions"]] == [(topic, 0), (topic, 1)]
        for part in txn["partitions"]:
            assert part["last_stable_offset"] == lso[part["partition"]] == 0
            assert part["high_watermark"] == hw[part["partition"]]
            assert part["held_back"] == hw[part["partition"]] - lso[part["partition"]]
        assert txn["held_back"] == 8
    long_open = kafka_cli("list", "--min-open", "1h", "-o", "json").json()["transactions"]
    assert not {doomed, kept} & {t["transactional_id"] for t in long_open}
    by_state = kafka_cli("list", "--state", "completecommit", "--state", "Empty", "-o", "json").json()
    assert not {doomed, kept} & {t["transactional_id"] for t in by_state["transactions"]}
    table = run_kafka2pc("list", "--min-open", "0s", "--bootstrap-server", kafka_bootstrap, "--timeout", "60")  # option after
    assert table.returncode == 0, table
    doomed_line = next(line for line in table.stdout.splitlines() if line.startswith(doomed))
    assert "Ongoing" in doomed_line and f"{topic}-0" in doomed_line

    # -- describe
    described = kafka_cli("describe", doomed, "-o", "json")
    assert described.returncode == 0, described
    documented_shape(described.json(), "describe")
    doomed_before = described.json()["transaction"]
    assert {k: doomed_before[k] for k in ("state", "producer_id", "producer_epoch", "partitions")} == {
        k: ours[0][k] for k in ("state", "producer_id", "producer_epoch", "partitions")
    }
    text = kafka_cli("describe", doomed)
    assert "State:            Ongoing" in text.stdout and f"{topic}-1" in text.stdout, text

    # -- cross-check with Apache Kafka's TransactionsCommand
    java_list = {row["TransactionalId"]: row for row in transactions_command(local_kafka, kafka_bootstrap, "list")}
    for txn in ours:
        row = java_list[txn["transactional_id"]]
        assert (int(row["ProducerId"]), row["TransactionState"]) == (txn["producer_id"], txn["state"])
    (java_describe,) = transactions_command(
        local_kafka, kafka_bootstrap, "describe", "--transactional-id", doomed
    )
    assert java_describe["TransactionalId"] == doomed
    assert int(java_describe["ProducerId"]) == doomed_before["producer_id"]
    assert int(java_describe["ProducerEpoch"]) == doomed_before["producer_epoch"]
    assert java_describe["TransactionState"] == doomed_before["state"]
    assert int(java_describe["CurrentTransactionStartTimeMs"]) == doomed_before["start_time_ms"]
    assert set(java_describe["TopicPartitions"].split(",")) == {
        f"{p['topic']}-{p['partition']}" for p in doomed_before["partitions"]
    }

    # -- complete: the kept transaction's stored state commits it (dry run first: nothing changes)
    kept_state = txns[kept].states[0]
    wrong_id = kafka_cli("complete", doomed, kept_state)
    assert wrong_id.returncode == ExitCode.USAGE and "another transactional.id" in wrong_id.stderr, wrong_id
    dry = kafka_cli("complete", kept, kept_state, "--dry-run")
    assert dry.returncode == 0, dry
    assert dry.stdout.startswith("decision: commit") and "nothing changed" in dry.stdout
    still = kafka_cli("describe", kept, "-o", "json").json()["transaction"]
    assert still["state"] == "Ongoing" and still["producer_epoch"] == ours[1]["producer_epoch"]
    done = kafka_cli("complete", kept, kept_state)
    assert done.returncode == 0, done
    assert "decision: commit" in done.stdout and "outcome: committed" in done.stdout

    # -- force-terminate: declining changes nothing; --yes aborts and fences
    declined = kafka_cli("force-terminate", doomed, input="n\n")
    assert declined.returncode == ExitCode.FAILURE and "nothing was terminated" in declined.stderr, declined
    assert f"Abort the Ongoing transaction of {doomed!r}" in declined.stdout
    assert kafka_cli("describe", doomed, "-o", "json").json()["transaction"]["state"] == "Ongoing"
    terminated = kafka_cli("force-terminate", doomed, "--yes")
    assert terminated.returncode == 0, terminated
    old_pid, old_epoch = doomed_before["producer_id"], doomed_before["producer_epoch"]
    assert (
        f"aborted its Ongoing transaction (producer id {old_pid}, epoch {old_epoch}) on {topic}-0, {topic}-1"
        in terminated.stdout
    )

    # A read_committed consumer sees every record of the committed one, none of the terminated one.
    visible = {(r.partition, r.offset) for r in drain(kafka_bootstrap, topic, "read_committed")}
    assert visible == txns[kept].offsets(0)
    assert not visible & txns[doomed].offsets(0)
    assert end_offsets(kafka_bootstrap, topic, "read_committed") == end_offsets(kafka_bootstrap, topic)

    # The killed process's producer id/epoch is fenced.
    # (The coordinator bumps the epoch once to fence the open transaction's producer and
    # once more for the new InitProducerId: 0 -> 2 on Kafka 4.3.1.)
    after = kafka_cli("describe", doomed, "-o", "json").json()["transaction"]
    assert after["producer_id"] == old_pid and after["producer_epoch"] > old_epoch
    assert f"epoch {old_epoch} -> {after['producer_epoch']}" in terminated.stdout
    assert after["state"] in ("CompleteAbort", "Empty") and after["partitions"] == []
    with ControlPlane({"bootstrap.servers": kafka_bootstrap}, request_timeout_s=15) as control:
        with pytest.raises(ProducerFencedError):
            control.end_txn(doomed, old_pid, old_epoch, commit=True)

    # Completing the terminated transaction now is a heuristic outcome: exit code 3.
    heuristic = kafka_cli("complete", doomed, txns[doomed].states[0])
    assert heuristic.returncode == ExitCode.HEURISTIC, heuristic
    assert "decision: nothing to do" in heuristic.stdout and "HEURISTIC OUTCOME" in heuristic.stderr
