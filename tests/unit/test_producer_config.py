"""Configuration errors surface as ``UsageError`` from the constructor, naming the key (no broker needed)."""

from __future__ import annotations

import pytest

from kafka2pc import Kafka2pcError, TwoPhaseCommitProducer, UsageError

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
    producer = TwoPhaseCommitProducer({**BASE, "acks": "all", "linger.ms": 5, "kafka2pc.anchor.topic": "my-anchors",
                                       "delivery.report.only.error": False})
    producer.close()


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

    from kafka2pc._producer import DELIVERY_REPORTS_CONFIG

    assert sink_key == DELIVERY_REPORTS_CONFIG
