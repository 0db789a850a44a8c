"""KIP-939's dual-write recipe on SQLAlchemy 2.x: one database transaction, one Kafka transaction, one outcome.

The application writes rows and produces records inside one block; the
recipe makes both land or neither::

    import sqlalchemy as sa
    from kafka2pc.recipes.dual_write import DualWriter, define_state_table

    metadata = sa.MetaData()
    define_state_table(metadata)                # kafka_transaction_state
    metadata.create_all(engine)

    writer = DualWriter(engine, {"bootstrap.servers": "localhost:9092",
                                 "transactional.id": "orders-1"})
    writer.recover()                            # at start-up, before new work
    with Session(engine) as session:
        with writer.transaction(session) as tx:
            session.add(Order(id=42))
            tx.produce("orders", key=b"42", value=b"created")

Normal path (the KIP's "normal processing recipe", in this order):

1. begin the database transaction.  SQLite and row-locking databases: lock
   this transactional id's state row (SQLite: the database write lock) and
   check that it still carries the version this writer committed last, so a
   second instance with the same id blocks here, before it produces
   anything.  PostgreSQL: nothing is locked (optimistic; step 5 checks);
2. begin the Kafka transaction;
3. the application produces records and writes rows;
4. prepare the Kafka transaction (flush; returns the :class:`PreparedTxnState`);
5. store the prepared state in the state row (and, with ``retain_records``,
   the records in an outbox table).  On PostgreSQL the update is guarded: it
   fails unless the row is still the version this writer wrote last (its
   ``xmin``), so a writer another instance took over rolls back here instead
   of committing a transaction Kafka no longer holds;
6. commit the database transaction: **the decision point** (on PostgreSQL
   with a Connection, sent together with step 5 in one round trip);
7. commit the Kafka transaction.

An exception before step 6 rolls back the database and aborts Kafka.  When the
outcome of step 6 is unknown (the connection died during COMMIT) or step 7
fails, the recipe does not guess: it reads the stored state back from the
database (waiting on the row lock, so an unfinished commit finishes first) and
lets ``complete_transaction`` commit the Kafka transaction if and only if the
database holds its state.

Recovery (the KIP's "recovery recipe", :meth:`DualWriter.recover`): claim the
state row (lock it, read the stored state, give it a new version and COMMIT
that: from then on no older instance can commit its database side), then
``init_transactions(keep_prepared_txn=True)``
and ``complete_transaction(stored_state)`` with a fresh producer (which fences
any older instance), then accept new work.  If Kafka had already aborted the
transaction the database committed (the owner was down longer than
``transaction.timeout.ms``: librdkafka cannot open timeout-free 2PC
transactions), that *heuristic outcome* is raised as
:class:`~kafka2pc.HeuristicOutcomeError`, or, with ``retain_records=True``,
repaired: the records kept in the outbox table are re-published in a new
two-phase transaction, so even that case delivers them exactly once.

Many instances sharing one database need no hand-made ids:
:class:`WriterPool` leases transactional ids from a bounded set recorded in
that database (:func:`define_lease_table`), gives each concurrent transaction its own
producer, and settles the ids of instances that died (``docs/deploying.md``).

See ``docs/dual-write.md`` for the failure analysis and the metrics.
"""

from typing import TYPE_CHECKING, Any

from kafka2pc import OnHeuristic, UnknownTopicError
from kafka2pc._deprecation import renamed
from kafka2pc._extras import missing_extra

try:
    import sqlalchemy  # noqa: F401 - the recipe's one hard dependency, checked up front
except ImportError as exc:
    raise missing_extra(exc, extra="sql", feature="kafka2pc.recipes.dual_write") from exc

from ._bind import Bind
from ._events import StepListener
from ._handle import DualWriteTransaction
from ._lease import DEFAULT_LEASE_TABLE, Lease, define_lease_table
from ._lifecycle import PoolState, WriterState
from ._options import WriterOptions
from ._pool import PoolExhaustedError, PoolMetrics, WriterPool
from ._schema import (
    DEFAULT_OUTBOX_TABLE,
    DEFAULT_STATE_TABLE,
    define_outbox_table,
    define_state_table,
    drop_state_function_sql,
    state_function_sql,
)
from ._store import MySQLStore, PostgresStore, RowLockStore, SQLiteStore, StateStore, store_for
from ._values import (
    DualWriteMetrics,
    MissingTableError,
    RecoveryResult,
    StateRowLockedError,
    Step,
    StepHook,
    TransactionMisuseError,
)
from ._writer import DualWriter, recover_all

__all__ = [
    "DEFAULT_LEASE_TABLE",
    "DEFAULT_OUTBOX_TABLE",
    "DEFAULT_STATE_TABLE",
    "Bind",
    "DualWriteMetrics",
    "DualWriteTransaction",
    "DualWriter",
    "Lease",
    "MissingTableError",
    "MySQLStore",
    "OnHeuristic",
    "PoolExhaustedError",
    "PoolMetrics",
    "PoolState",
    "PostgresStore",
    "RecoveryResult",
    "RowLockStore",
    "SQLiteStore",
    "StateRowLockedError",
    "StateStore",
    "Step",
    "StepHook",
    "StepListener",
    "TransactionMisuseError",
    "WriterOptions",
    "WriterPool",
    "WriterState",
    "define_lease_table",
    "define_outbox_table",
    "define_state_table",
    "drop_state_function_sql",
    "recover_all",
    "state_function_sql",
    "store_for",
]

# 0.1 and rc1 names, kept for one minor release: each access warns and names the replacement.
_RENAMED: dict[str, tuple[Any, str]] = {
    "state_table": (define_state_table, "kafka2pc.recipes.dual_write.define_state_table"),
    "outbox_table": (define_outbox_table, "kafka2pc.recipes.dual_write.define_outbox_table"),
    "lease_table": (define_lease_table, "kafka2pc.recipes.dual_write.define_lease_table"),
    "TopicNotFoundError": (UnknownTopicError, "kafka2pc.UnknownTopicError"),
}

if not TYPE_CHECKING:  # type checkers see only the 1.0 names

    def __getattr__(name: str) -> Any:
        entry = _RENAMED.get(name)
        if entry is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        renamed(f"kafka2pc.recipes.dual_write.{name}", entry[1])
        return entry[0]
