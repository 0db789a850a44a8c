"""The configuration of a :class:`~kafka2pc.TwoPhaseCommitProducer`: checked once, then built for librdkafka.

:func:`parse_config` takes the dict a user passes (confluent-kafka's keys plus
kafka2pc's own, :data:`ANCHOR_TOPIC_CONFIG` and :data:`DELIVERY_REPORTS_CONFIG`),
refuses what kafka2pc cannot honour with a :class:`UsageError` naming the key,
and returns :class:`ProducerSettings`.  :func:`check_broker` and
:func:`librdkafka_config` ask the cluster, at ``init_transactions``, what the
broker offers and which ``transaction.timeout.ms`` to run with.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaException, Producer

from kafka2pc._control import ControlPlane
from kafka2pc._errors import kafka_error_of
from kafka2pc._exceptions import UnsupportedBrokerError, UsageError
from kafka2pc._logging import with_librdkafka_logger

__all__ = [
    "ANCHOR_TOPIC_CONFIG",
    "ANCHOR_TOPIC_PARTITIONS",
    "DEFAULT_ANCHOR_TOPIC",
    "DELIVERY_REPORTS_CONFIG",
    "LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS",
    "TWO_PC_CONFIG",
    "ProducerSettings",
    "check_broker",
    "librdkafka_config",
    "parse_config",
]

logger = logging.getLogger("kafka2pc._producer")  # one logger name for the producer's modules

TWO_PC_CONFIG = "transaction.two.phase.commit.enable"
ANCHOR_TOPIC_CONFIG = "kafka2pc.anchor.topic"
DELIVERY_REPORTS_CONFIG = "kafka2pc.delivery.reports"
"""``"all"`` (default) or ``"errors"``: which delivery reports reach Python (see :class:`TwoPhaseCommitProducer`)."""
DEFAULT_ANCHOR_TOPIC = "kafka2pc-anchors"
"""Topic of the marker records that anchor offsets-only transactions (see :mod:`kafka2pc._state`)."""
ANCHOR_TOPIC_PARTITIONS = 8
"""Partitions of an anchor topic kafka2pc creates: markers of different ids spread over them.

A prepared transaction holds back its anchor partition's last stable offset,
which only delays the *outcome* probe of other ids' markers on that partition;
spreading the ids keeps that rare.
"""
_TOPIC_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,249}")
_REQUIRED_APIS = ("InitProducerId", "EndTxn", "DescribeTransactions", "DescribeProducers", "ListOffsets")
_timeout_warning_logged = False

LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS = 2_147_483
"""The largest ``transaction.timeout.ms`` librdkafka handles: 2**31 microseconds.

Above it librdkafka's request deadlines wrap around (a 32-bit microsecond
count): requests time out the moment they are queued ("Timed out 1
out-queue" storms) and transactions stall for seconds.  Measured with
librdkafka 2.16 against a broker whose ``transaction.max.timeout.ms`` is one
hour: 2,147,483 ms ran clean, 2,200,000 ms did not, 3,600,000 ms ran at less
than half the throughput.  kafka2pc caps the timeout it picks here and
refuses a larger one set explicitly.
"""


def _as_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise UsageError(f"{name} must be true or false, not {value!r}")


def _check_librdkafka_config(conf: Mapping[str, Any]) -> None:
    """Raise :class:`UsageError` naming the key if librdkafka refuses ``conf`` (unknown key, bad value,
    ``acks`` other than ``all``, ``enable.idempotence=false``...).

    librdkafka validates the whole configuration when a client is created; a
    throwaway producer without bootstrap servers (it connects to nothing,
    about 3 ms) lets the constructor report what would otherwise surface as a
    raw ``KafkaException`` at ``init_transactions``.
    """
    probe = {k: v for k, v in conf.items() if k not in ("bootstrap.servers", "metadata.broker.list")}
    probe["log_level"] = 0  # no "no bootstrap.servers configured" notice
    try:
        Producer(probe)
    except KafkaException as exc:
        err = kafka_error_of(exc)
        detail = err.str() if err is not None else str(exc)
        raise UsageError(f"invalid producer configuration: {detail}") from exc
    except (TypeError, ValueError) as exc:
        raise UsageError(f"invalid producer configuration: {exc}") from exc



@dataclass(frozen=True)
class ProducerSettings:
    """A producer configuration kafka2pc has checked, split into what librdkafka gets and what kafka2pc keeps."""

    transactional_id: str
    librdkafka: dict[str, Any]
    """The configuration passed to librdkafka (kafka2pc's own keys and ``on_delivery`` removed)."""
    two_pc_requested: bool
    """``transaction.two.phase.commit.enable`` was set: the broker must offer KIP-939's 2PC."""
    anchor_topic: str
    errors_only: bool
    """``kafka2pc.delivery.reports=errors``: only failed deliveries reach Python."""
    default_callback: Callable[..., Any] | None
    """The configuration's ``on_delivery``: the callback of records sent without one of their own."""


def parse_config(config: Mapping[str, Any]) -> ProducerSettings:
    """Check a :class:`~kafka2pc.TwoPhaseCommitProducer` configuration; :class:`UsageError` names what is wrong."""
    conf = dict(config)
    tid = conf.get("transactional.id")
    if not isinstance(tid, str) or not tid:
        raise UsageError("config must set 'transactional.id' to a non-empty string")
    two_pc_requested = _as_bool(conf.pop(TWO_PC_CONFIG, False), TWO_PC_CONFIG)
    anchor_topic = conf.pop(ANCHOR_TOPIC_CONFIG, DEFAULT_ANCHOR_TOPIC)
    if not isinstance(anchor_topic, str) or not _TOPIC_NAME_RE.fullmatch(anchor_topic) or anchor_topic in (
        ".", ".."
    ):
        raise UsageError(f"{ANCHOR_TOPIC_CONFIG} must be a valid topic name, not {anchor_topic!r}")
    reports = conf.pop(DELIVERY_REPORTS_CONFIG, "all")
    if reports not in ("all", "errors"):
        raise UsageError(f"{DELIVERY_REPORTS_CONFIG} must be 'all' or 'errors', not {reports!r}")
    if two_pc_requested and "transaction.timeout.ms" in conf:
        raise UsageError(
            f"{TWO_PC_CONFIG}=true and transaction.timeout.ms cannot be set together (KIP-939)"
        )
    if "transaction.timeout.ms" in conf:
        try:
            timeout_ms = int(conf["transaction.timeout.ms"])
        except (TypeError, ValueError):
            raise UsageError(
                f"transaction.timeout.ms must be an integer number of milliseconds, "
                f"not {conf['transaction.timeout.ms']!r}"
            ) from None
        if timeout_ms > LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS:
            raise UsageError(
                f"transaction.timeout.ms={timeout_ms} is above {LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS} "
                "(2**31 microseconds), where librdkafka's request timeouts wrap around and every "
                "request times out at once; leave it unset to get the broker's maximum within that limit"
            )
    if "delivery.report.only.error" in conf and _as_bool(
        conf["delivery.report.only.error"], "delivery.report.only.error"
    ):
        # The anchor of a prepared state is the first *successful* delivery report:
        # without them every transaction would look empty, and completing its state
        # would abort it.
        raise UsageError(
            "delivery.report.only.error=true is not supported: kafka2pc names each prepared transaction "
            f"by the offset its first record was delivered at, which only a successful delivery report says "
            f"(set {DELIVERY_REPORTS_CONFIG}=errors instead)"
        )
    errors_only = reports == "errors"
    if errors_only:
        conf["delivery.report.only.error"] = True
    default_cb = conf.pop("on_delivery", None)
    if default_cb is not None and not callable(default_cb):
        raise UsageError(f"on_delivery must be a callable (err, msg), not {default_cb!r}")
    _check_librdkafka_config(conf)
    return ProducerSettings(
        transactional_id=tid, librdkafka=conf, two_pc_requested=two_pc_requested, anchor_topic=anchor_topic,
        errors_only=errors_only, default_callback=default_cb,
    )


def check_broker(ctrl: ControlPlane, *, two_pc_requested: bool) -> None:
    """Raise :class:`UnsupportedBrokerError` if the cluster lacks an API kafka2pc needs, or refuses the 2PC asked."""
    versions = ctrl.api_versions()
    missing = [api for api in _REQUIRED_APIS if api not in versions]
    if missing:
        raise UnsupportedBrokerError(
            f"the broker does not support {', '.join(missing)}, which kafka2pc needs (Kafka >= 3.0)"
        )
    if two_pc_requested:
        # KIP-939 2PC needs the broker to offer it (InitProducerId v6 and the
        # broker setting) *and* the client to send Enable2Pc.  A broker that
        # refuses it is an error, as in KIP-939.  A broker that offers it is
        # accepted, but librdkafka cannot send Enable2Pc: transactions stay
        # bounded by transaction.timeout.ms (raised to the broker maximum, with
        # the warning logged in librdkafka_config).
        top = versions["InitProducerId"][1]
        enabled = ctrl.broker_config([TWO_PC_CONFIG]).get(TWO_PC_CONFIG)
        if top < 6 or enabled != "true":
            raise UnsupportedBrokerError(
                f"{TWO_PC_CONFIG}=true was asked, but the broker does not offer 2PC to clients: it "
                f"advertises InitProducerId up to v{top} (KIP-939 needs v6) and has "
                f"{TWO_PC_CONFIG}={enabled or 'absent'}. Drop the setting: prepared transactions are "
                "then bounded by the broker's transaction.max.timeout.ms, and one the broker aborts on "
                "timeout is reported by recovery as HeuristicOutcomeError",
                error_name="UNSUPPORTED_VERSION",
            )


def librdkafka_config(
    conf: Mapping[str, Any], ctrl: ControlPlane, on_delivery: Callable[..., Any]
) -> dict[str, Any]:
    """The configuration to create the librdkafka producer with.

    Without an explicit ``transaction.timeout.ms``, the broker's
    ``transaction.max.timeout.ms`` (asked of the cluster), capped at
    :data:`LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS`; librdkafka's logs go to
    :mod:`logging`; ``on_delivery`` is the producer-level delivery callback.
    """
    global _timeout_warning_logged
    result = dict(conf)
    if "transaction.timeout.ms" not in result:
        limit = ctrl.broker_config(["transaction.max.timeout.ms"]).get("transaction.max.timeout.ms")
        chosen = min(int(limit), LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS) if limit else None
        if chosen is not None:
            result["transaction.timeout.ms"] = chosen
        if not _timeout_warning_logged:
            _timeout_warning_logged = True
            logger.info(
                "librdkafka cannot open 2PC transactions (no Enable2Pc): prepared transactions are "
                "aborted by the broker after transaction.timeout.ms=%s ms (the broker's "
                "transaction.max.timeout.ms=%s%s); recovery reports such aborts as heuristic outcomes",
                chosen, limit,
                f", capped at librdkafka's limit of {LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS} ms"
                if chosen == LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS else "",
            )
    result["on_delivery"] = on_delivery
    return with_librdkafka_logger(result)  # librdkafka's logs -> logging (kafka2pc._logging)
