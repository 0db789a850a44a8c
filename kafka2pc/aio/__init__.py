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

__all__ = ["AsyncTransactionAdmin", "AsyncTwoPhaseCommitProducer", "LoopStallMonitor", "StallReport"]

for _name in __all__:
    globals()[_name].__module__ = "kafka2pc.aio"
del _name
