"""kafka2pc: Apache Kafka as a two-phase-commit participant (KIP-939), on confluent-kafka.

Public API (everything else lives in private modules)::

    from kafka2pc import TwoPhaseCommitProducer, PreparedTxnState

See ``README.md`` for the dual-write recipe, the recovery routine and the CLI.
"""

from typing import TYPE_CHECKING, Any

from kafka2pc._deadline import DEFAULT_CLOSE_TIMEOUT_S, DEFAULT_TIMEOUT_S, TIMEOUT_SLACK_S
from kafka2pc._exceptions import (
    AbortableError,
    AuthorizationError,
    BrokerUnavailableError,
    FatalError,
    ForkedProcessError,
    HeuristicOutcomeError,
    IllegalStateError,
    IndefiniteOutcomeError,
    InvalidPreparedStateError,
    Kafka2pcError,
    KafkaTransactionError,
    ProducerFencedError,
    QueueFullError,
    RetriableError,
    TransactionalIdMismatchError,
    UnknownTopicError,
    UnsupportedBrokerError,
    UsageError,
)
from kafka2pc._machine import TxnState
from kafka2pc._state import PreparedTxnState
from kafka2pc._types import (
    OnHeuristic,
    PartitionLag,
    ProducerState,
    TopicAndPartition,
    TransactionDescription,
    TransactionInfo,
)

if TYPE_CHECKING:
    from kafka2pc._admin import TransactionAdmin
    from kafka2pc._hanging import OpenTransaction
    from kafka2pc._producer import TwoPhaseCommitProducer
    from kafka2pc._reachability import unreachable_reason
    from kafka2pc._recovery import Decision, RecoveryPlan, Settlement, TransactionOutcome

# Names whose modules import confluent-kafka / kafka-python (~150 ms): loaded on
# first access (PEP 562) so that ``import kafka2pc`` -- and the CLI's ``--help`` --
# stay fast.  ``from kafka2pc import TwoPhaseCommitProducer`` works as before.
_LAZY = {
    "TransactionAdmin": "kafka2pc._admin",
    "OpenTransaction": "kafka2pc._hanging",
    "TwoPhaseCommitProducer": "kafka2pc._producer",
    "Decision": "kafka2pc._recovery",
    "RecoveryPlan": "kafka2pc._recovery",
    "Settlement": "kafka2pc._recovery",
    "TransactionOutcome": "kafka2pc._recovery",
    "unreachable_reason": "kafka2pc._reachability",
}

__version__ = "1.0.0"

__all__ = [
    "AbortableError",
    "AuthorizationError",
    "BrokerUnavailableError",
    "DEFAULT_CLOSE_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "Decision",
    "FatalError",
    "ForkedProcessError",
    "HeuristicOutcomeError",
    "IllegalStateError",
    "IndefiniteOutcomeError",
    "InvalidPreparedStateError",
    "Kafka2pcError",
    "KafkaTransactionError",
    "OnHeuristic",
    "OpenTransaction",
    "PartitionLag",
    "PreparedTxnState",
    "ProducerFencedError",
    "ProducerState",
    "QueueFullError",
    "RecoveryPlan",
    "RetriableError",
    "Settlement",
    "TIMEOUT_SLACK_S",
    "TopicAndPartition",
    "TransactionAdmin",
    "TransactionDescription",
    "TransactionInfo",
    "TransactionOutcome",
    "TransactionalIdMismatchError",
    "TwoPhaseCommitProducer",
    "TxnState",
    "UnknownTopicError",
    "UnsupportedBrokerError",
    "UsageError",
    "__version__",
    "unreachable_reason",
]

# 0.1 names, kept for one minor release: each access warns and names the replacement.
_DEPRECATED = {
    "TopicPartition": ("kafka2pc._types", "TopicAndPartition", "kafka2pc.TopicAndPartition"),
    "missing_extra": ("kafka2pc._extras", "missing_extra", "nothing: it is internal to kafka2pc"),
}


def _present_as_public(obj: Any) -> None:
    if hasattr(obj, "__module__"):
        try:
            obj.__module__ = "kafka2pc"
        except (AttributeError, TypeError):
            pass


if not TYPE_CHECKING:  # type checkers see the imports above; a visible __getattr__ would hide typos

    def __getattr__(name: str) -> Any:
        if name in _DEPRECATED:
            import importlib

            from kafka2pc._deprecation import renamed

            module_name, attribute, replacement = _DEPRECATED[name]
            renamed(f"kafka2pc.{name}", replacement)
            return getattr(importlib.import_module(module_name), attribute)
        module_name = _LAZY.get(name)
        if module_name is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        module = importlib.import_module(module_name)
        for lazy_name, lazy_module in _LAZY.items():
            if lazy_module == module_name:
                obj = getattr(module, lazy_name)
                _present_as_public(obj)
                globals()[lazy_name] = obj
        return globals()[name]

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(__all__))


for _name in __all__:
    if _name != "__version__" and _name not in _LAZY and not _name.isupper():
        _present_as_public(globals()[_name])
del _name
