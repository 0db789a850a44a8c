"""Configuration errors surface as ``UsageError`` from the constructor, naming the key (no broker needed)."""

from __future__ import annotations

import select
import socket

import pytest

from kafka2pc import Kafka2pcError, TwoPhaseCommitProducer, TxnState, UsageError

BASE = {"bootstrap.servers": "127.0.0.1:1", "transactional.id": "k2pc-config"}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"acks": 1}, "acks"),
        ({"acks": "0"}, "acks"),
        ({"enable.idempotence": False}, "enable.idempotence"),
        ({"no.such.key": "1"}, "no.such.key"),
        ({"linger.ms": "soon"}, "queue.buffering.max.ms"),  # librdkafka names linger.ms by its alias
        ({"kafka2pc.anchor.topic": "bad/topic"}, "kafka2pc.anchor.topic"),
        ({"transaction.timeout.ms": "an hour"}, "transaction.timeout.ms"),
        # Without successful delivery reports every prepared state would read "sent nothing".
        ({"delivery.report.only.error": True}, "delivery.report.only.error"),
        ({"delivery.report.only.error": "true"}, "delivery.report.only.error"),
        ({"delivery.report.only.error": "maybe"}, "delivery.report.only.error"),
        ({"kafka2pc.delivery.reports": "some"}, "kafka2pc.delivery.reports"),
    ],
)
def test_bad_configuration_is_a_usage_error_from_the_constructor(extra: dict[str, object], named: str) -> None:
    with pytest.raises(UsageError, match=named.replace(".", r"\.")) as raised:
        TwoPhaseCommitProducer({**BASE, **extra})
    assert isinstance(raised.value, Kafka2pcError)


def test_valid_configuration_constructs_without_connecting() -> None:
    """A valid configuration is accepted, and nothing talks to the cluster before ``init_transactions``."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        port = listener.getsockname()[1]
        producer = TwoPhaseCommitProducer({
            **BASE, "bootstrap.servers": f"127.0.0.1:{port}", "acks": "all", "linger.ms": 5,
            "kafka2pc.anchor.topic": "my-anchors", "delivery.report.only.error": False,
        })
        try:
            assert producer.state is TxnState.UNINITIALIZED
            assert producer.transactional_id == BASE["transactional.id"]
            # A client connects to its bootstrap server within milliseconds of being created.
            readable, _, _ = select.select([listener], [], [], 0.5)
            assert readable == [], "the constructor connected to the bootstrap server"
        finally:
            producer.close()
        assert producer.state is TxnState.CLOSED


def test_the_spark_sink_names_the_delivery_reports_setting_the_producer_reads() -> None:
    """The sink spells the setting without importing the core's private module; the two must agree."""
    import ast
    from pathlib import Path

    source = Path(__file__).resolve().parents[2] / "recipes" / "spark" / "_config.py"  # without PySpark installed
    sink_key = next(
        node.value.value for node in ast.parse(source.read_text()).body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        and any(isinstance(t, ast.Name) and t.id == "DELIVERY_REPORTS_CONFIG" for t in node.targets)
    )

    from kafka2pc._producer_config import DELIVERY_REPORTS_CONFIG

    assert sink_key == DELIVERY_REPORTS_CONFIG
