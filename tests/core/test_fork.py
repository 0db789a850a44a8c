"""Fork detection: a producer or an admin inherited through fork() fails at once in the child.

Each object is made and used in the test process, which then forks (a bare
``os.fork()`` and ``multiprocessing``'s ``fork`` context).  In the child every
call raises :class:`kafka2pc.ForkedProcessError` within a second, naming the
creator's pid, and ``close()`` returns at once; nothing is sent from the child.
The parent keeps working with the same object afterwards.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from harness.forks import FORK_KINDS, in_forked_child

from kafka2pc import ForkedProcessError, TransactionAdmin, TwoPhaseCommitProducer, TxnState
from kafka2pc.testing import create_topic, drain


def attempts(calls: dict[str, Callable[[], Any]], close: Callable[[], Any]) -> Callable[[], dict[str, Any]]:
    """In the child: each call's error (class, pid, message) and duration, then close()'s duration."""

    def run() -> dict[str, Any]:
        seen: dict[str, Any] = {"pid": os.getpid()}
        for name, call in calls.items():
            started = time.monotonic()
            try:
                call()
                seen[name] = {"error": None}
            except ForkedProcessError as exc:
                seen[name] = {"error": "ForkedProcessError", "pid": exc.pid, "message": str(exc)}
            except Exception as exc:  # noqa: BLE001 - reported, and the test fails on it
                seen[name] = {"error": f"{type(exc).__name__}: {exc}"}
            seen[name]["seconds"] = time.monotonic() - started
        started = time.monotonic()
        close()
        seen["close_seconds"] = time.monotonic() - started
        return seen

    return run


def assert_refused_at_once(seen: dict[str, Any], calls: list[str]) -> None:
    assert seen["pid"] != os.getpid()
    for name in calls:
        assert seen[name]["error"] == "ForkedProcessError", (name, seen[name])
        assert seen[name]["pid"] == os.getpid(), (name, seen[name])
        message = seen[name]["message"]
        assert f"made in process {os.getpid()}" in message and "forked" in message, message
        assert "post_worker_init" in message and "worker_process_init" in message, message
        assert seen[name]["seconds"] < 1.0, (name, seen[name])
    assert seen["close_seconds"] < 1.0, seen


@pytest.mark.parametrize("kind", FORK_KINDS)
def test_producer_used_in_a_forked_child_raises_at_once_and_the_parent_goes_on(
    kafka_bootstrap: str, kind: str
) -> None:
    topic = create_topic(kafka_bootstrap)
    producer = TwoPhaseCommitProducer(
        {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"k2pc-fork-{uuid.uuid4().hex[:8]}"}
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"before the fork")
    producer.commit_transaction(30)  # warmed up: a live librdkafka producer and control plane

    calls: dict[str, Callable[[], Any]] = {
        "begin_transaction": producer.begin_transaction,
        "produce": lambda: producer.produce(topic, value=b"from the child"),
        "flush": lambda: producer.flush(5),
        "prepare_transaction": lambda: producer.prepare_transaction(5),
        "abort_transaction": lambda: producer.abort_transaction(5),
    }
    seen = in_forked_child(kind, attempts(calls, lambda: producer.close(5)))
    assert_refused_at_once(seen, list(calls))

    # The parent's producer was not touched by the child (not closed, not fenced).
    assert producer.state is TxnState.READY
    producer.begin_transaction()
    producer.produce(topic, value=b"after the fork")
    state = producer.prepare_transaction(30)
    producer.complete_transaction(state, 30)
    assert sorted(r.value for r in drain(kafka_bootstrap, topic)) == [b"after the fork", b"before the fork"]
    producer.close()


@pytest.mark.parametrize("kind", FORK_KINDS)
def test_admin_used_in_a_forked_child_raises_at_once_and_the_parent_goes_on(kafka_bootstrap: str, kind: str) -> None:
    admin = TransactionAdmin({"bootstrap.servers": kafka_bootstrap})
    assert admin.describe_transaction("k2pc-fork-never-used") is None  # connected before the fork
    calls: dict[str, Callable[[], Any]] = {
        "describe_transaction": lambda: admin.describe_transaction("k2pc-fork-never-used"),
        "list_transactions": admin.list_transactions,
        "topic_names": admin.topic_names,
        "control_plane.describe_transaction": lambda: admin.control_plane.describe_transaction("k2pc-fork-x"),
    }
    def close() -> None:  # the plane's own close() too: in the child it closes nothing of the parent's
        admin.control_plane.close()
        admin.close(5)

    seen = in_forked_child(kind, attempts(calls, close))
    assert_refused_at_once(seen, list(calls))
    assert admin.describe_transaction("k2pc-fork-never-used") is None
    admin.close()
