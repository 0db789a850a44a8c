"""The control plane: requests straight to the transaction coordinator.

confluent-kafka (librdkafka) has no KIP-939 API, does not expose the producer
id and epoch, and its ``init_transactions()`` always aborts an open
transaction.  Completing a prepared transaction after a crash therefore needs
a second client that speaks the transactional wire APIs itself:
FindCoordinator, DescribeTransactions, DescribeProducers, ListTransactions,
EndTxn and InitProducerId.  This package is that client, built on kafka-python
3.0's connection manager and message schemas; it holds no recovery policy
(what to commit, when) -- that lives in the core.

Split by concern:

* :mod:`._config` -- one client configuration (confluent-kafka dict) mapped
  to librdkafka connection settings and kafka-python settings;
* :mod:`._retry` -- one retry routine keyed by route (coordinator or
  partition leader), with named wire errors and a caller's deadline;
* :mod:`._protocol` -- the requests, built with kafka-python's schemas;
* :mod:`._kafka_python` -- every use of kafka-python internals;
* :mod:`._outcome_probe` -- the ``read_committed`` probe of one record;
* :mod:`._diagnosis` -- why a secured cluster is unreachable (asked of librdkafka);
* :mod:`._session` -- the connection: lazy connect, per-call deadlines, routed retries;
* :mod:`._plane` -- :class:`ControlPlane`, the calls themselves.

Facts this package relies on, each observed against Apache Kafka 4.3.1 (KRaft,
``transaction.version`` finalized at 2) and librdkafka 2.x (see the tests in
``tests/control``):

* librdkafka runs transaction version 1: consecutive transactions of one
  producer share ``{producer_id, epoch}``; the anchor offset
  (DescribeProducers' ``CurrentTxnStartOffset``) is what tells them apart.
* EndTxn v5+ switches the coordinator to TV2 semantics (it bumps the epoch on
  completion and answers with the new one), so :meth:`ControlPlane.end_txn`
  never sends more than v4.
* InitProducerId v6 (KIP-939 ``Enable2Pc``/``KeepPreparedTxn``) is marked
  unstable in 4.3.1: the broker does not advertise it and closes the
  connection if it is sent.  With ``unstable.api.versions.enable=true`` the
  coordinator answers ``KeepPreparedTxn=true`` with UNSUPPORTED_VERSION and
  leaves the ongoing transaction untouched.
"""

from __future__ import annotations

from kafka2pc._kafka_python_import import kafka as _kafka  # imports kafka-python without its DeprecationWarning

if int(str(getattr(_kafka, "__version__", "0")).split(".")[0]) < 3:
    raise ImportError(
        f"kafka2pc's control plane is built on kafka-python 3.0 and found kafka-python "
        f"{getattr(_kafka, '__version__', '?')}: pip install 'kafka-python>=3.0,<3.1'"
    )

from kafka2pc._control._config import (  # noqa: E402 - after the version check
    ConnectionSettings,
    connection_settings,
    kafka_python_config,
    librdkafka_connection_config,
)
from kafka2pc._control._plane import (
    DEFAULT_CONTROL_TIMEOUT_S,
    DEFAULT_FENCE_TRANSACTION_TIMEOUT_MS,
    DEFAULT_REQUEST_TIMEOUT_S,
    ControlPlane,
    fence_transaction_timeout_ms,
)

__all__ = [
    "DEFAULT_CONTROL_TIMEOUT_S",
    "DEFAULT_FENCE_TRANSACTION_TIMEOUT_MS",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "ConnectionSettings",
    "ControlPlane",
    "connection_settings",
    "fence_transaction_timeout_ms",
    "kafka_python_config",
    "librdkafka_connection_config",
]
