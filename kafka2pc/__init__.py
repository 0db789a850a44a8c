"""kafka2pc: Apache Kafka as a two-phase-commit participant (KIP-939), on confluent-kafka.

Public API (everything else lives in private modules)::

    from kafka2pc import TwoPhaseCommitProducer, PreparedTxnState

See ``README.md`` for the dual-write recipe, the recovery routine and the CLI.
"""

from kafka2pc._admin import TransactionAdmin, TransactionInfo
from kafka2pc._exceptions import (
    AbortableError,
    AuthorizationError,
    BrokerUnavailableError,
    FatalError,
    HeuristicOutcomeError,
    IllegalStateError,
    IndefiniteOutcomeError,
    InvalidPreparedStateError,
    Kafka2pcError,
    KafkaTransactionError,
    ProducerFencedError,
    RetriableError,
    TransactionalIdMismatchError,
    UnsupportedBrokerError,
    UsageError,
)
from kafka2pc._machine import TxnState
from kafka2pc._producer import QueueFullError, TwoPhaseCommitProducer
from kafka2pc._recovery import Decision, RecoveryPlan, Settlement, TransactionOutcome
from kafka2pc._state import PreparedTxnState
from kafka2pc._types import TopicPartition

__version__ = "0.1.0"

__all__ = [
    "AbortableError",
    "AuthorizationError",
    "BrokerUnavailableError",
    "Decision",
    "FatalError",
    "HeuristicOutcomeError",
    "IllegalStateError",
    "IndefiniteOutcomeError",
    "InvalidPreparedStateError",
    "Kafka2pcError",
    "KafkaTransactionError",
    "PreparedTxnState",
    "ProducerFencedError",
    "QueueFullError",
    "RecoveryPlan",
    "RetriableError",
    "Settlement",
    "TopicPartition",
    "TransactionAdmin",
    "TransactionInfo",
    "TransactionOutcome",
    "TransactionalIdMismatchError",
    "TwoPhaseCommitProducer",
    "TxnState",
    "UnsupportedBrokerError",
    "UsageError",
    "__version__",
]

for _name in __all__:
    _obj = globals()[_name]
    if hasattr(_obj, "__module__") and _name != "__version__":
        try:
            _obj.__module__ = "kafka2pc"
        except (AttributeError, TypeError):
            pass
del _name, _obj
