"""kafka2pc for asyncio: the producer and the admin facade without blocking the event loop.

::

    from kafka2pc.aio import AsyncTwoPhaseCommitProducer, AsyncTransactionAdmin

Both wrap their sync counterparts (:class:`kafka2pc.TwoPhaseCommitProducer`,
:class:`kafka2pc.TransactionAdmin`): same state machine, same
:class:`kafka2pc.PreparedTxnState`, same exception classes.  Each instance
runs its blocking calls in one dedicated thread, in call order.
:class:`LoopStallMonitor` measures how long the loop was held up, for tests
and benchmarks.  See ``docs/asyncio.md``.
"""

from kafka2pc.aio._admin import AsyncTransactionAdmin
from kafka2pc.aio._producer import AsyncTwoPhaseCommitProducer
from kafka2pc.aio._stall import LoopStallMonitor, StallReport

__all__ = ["AsyncTransactionAdmin", "AsyncTwoPhaseCommitProducer", "LoopStallMonitor", "StallReport", "UNPAIRED"]

UNPAIRED: dict[str, str] = {
    # -- asyncio only --------------------------------------------------------------------------
    "kafka2pc.aio.AsyncTwoPhaseCommitProducer.produce_and_wait":
        "awaiting a record's delivery is asyncio's idiom (aiokafka's send_and_wait); a sync caller flushes",
    "kafka2pc.aio.AsyncTwoPhaseCommitProducer.wait_idle":
        "a cancelled task's call still runs in the producer's thread; a sync call cannot be left running",
    "kafka2pc.aio.AsyncTwoPhaseCommitProducer.in_flight":
        "the calls queued behind the producer's thread; a sync producer runs one call at a time, in the caller",
    "kafka2pc.aio.AsyncTwoPhaseCommitProducer.sync_producer":
        "the sync producer an asyncio one drives from its thread; a sync producer wraps no other",
    "kafka2pc.aio.AsyncTransactionAdmin.sync_admin":
        "the sync admin an asyncio one drives from its thread; a sync admin wraps no other",
    "kafka2pc.aio.AsyncTwoPhaseCommitProducer.__init__(delivery_poll_interval_s)":
        "how often the producer's own thread serves delivery reports; a sync caller serves them with poll()",
    "kafka2pc.aio.AsyncTwoPhaseCommitProducer.__init__(queue_full_timeout_s)":
        "produce() waits for room without blocking the loop; the sync produce() raises QueueFullError at once",
    "kafka2pc.aio.LoopStallMonitor":
        "measures how long an event loop could not run; without a loop there is nothing to measure",
    "kafka2pc.aio.StallReport":
        "what a LoopStallMonitor saw (see LoopStallMonitor)",
    "kafka2pc.recipes.dual_write.aio.AsyncDualWriteTransaction.__init__(handle)":
        "made by AsyncDualWriter.transaction(), never by users: it wraps the sync handle",
    # -- sync only ------------------------------------------------------------------------------
    "kafka2pc.TwoPhaseCommitProducer.control_plane":
        "the coordinator client of the producer's own thread; an asyncio producer's is used from its thread only",
    "kafka2pc.TwoPhaseCommitProducer.__init__(control_plane)":
        "shares another client's connections, which are used from one thread; an asyncio producer has its own",
    "kafka2pc.TransactionAdmin.control_plane":
        "the coordinator client of the caller's thread; an asyncio admin's is used from its own thread only",
    "kafka2pc.TransactionAdmin.__init__(control_plane)":
        "shares another client's connections, which are used from one thread; an asyncio admin has its own",
    "kafka2pc.recipes.dual_write.DualWriteTransaction.__init__(writer)":
        "made by DualWriter.transaction(), never by users",
    "kafka2pc.recipes.dual_write.DualWriteTransaction.__init__(producer)":
        "made by DualWriter.transaction(), never by users",
    "kafka2pc.recipes.dual_write.DualWriteTransaction.__init__(connection)":
        "made by DualWriter.transaction(), never by users",
    "kafka2pc.recipes.dual_write.recover_all(max_workers)":
        "the sync recovery runs the writers in a thread pool of that size; the asyncio one runs them all on the loop",
    "kafka2pc.recipes.spark.KafkaTwoPhaseSink":
        "Spark calls a foreachBatch function from its own threads, with no event loop to run a coroutine on",
}
"""What has no asyncio (or no sync) twin, and why: ``qualified name`` or ``qualified callable(argument)`` -> reason.

Every other public class, method, property and argument of
:mod:`kafka2pc` and :mod:`kafka2pc.recipes.dual_write` has its twin in
:mod:`kafka2pc.aio` and :mod:`kafka2pc.recipes.dual_write.aio` (``AsyncX``
for ``X``), with the same name and the same arguments;
``tests/unit/test_api_parity.py`` checks both, and ``docs/asyncio.md`` lists this.
"""

for _name in __all__:
    if not _name.isupper():
        globals()[_name].__module__ = "kafka2pc.aio"
del _name
