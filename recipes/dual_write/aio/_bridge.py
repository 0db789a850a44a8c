"""How the sync recipe's code runs on an event loop without blocking it.

SQLAlchemy's asyncio extension runs sync ORM and Core code inside a greenlet
spawned from the loop (``greenlet_spawn``); where that code would wait on the
database, the async driver's coroutine is handed back to the loop
(``await_``) and the greenlet resumes with its result.  The recipe's own
code (:class:`~kafka2pc.recipes.dual_write.DualWriter`'s normal path,
settlement and recovery, and the :class:`StateStore` SQL) runs the same way
here, unchanged, and everything in it that would wait on Kafka is answered
the same way:

* the producer is :class:`_GreenletProducer`, whose methods hand the
  coroutine of an :class:`~kafka2pc.aio.AsyncTwoPhaseCommitProducer` (its own
  thread, calls in order) to the loop;
* a recovery plan or a transaction's outcome read from the control plane and
  the topic check run in a short-lived thread each (:class:`OffLoop`);
* the pause between two settlement attempts is an ``asyncio.sleep``.

The recipe's Python code itself runs on the loop's thread between those
waits: a few hundred microseconds per transaction.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sqlalchemy.util import greenlet_spawn

from kafka2pc import DEFAULT_CLOSE_TIMEOUT_S, PreparedTxnState, Settlement, TxnState
from kafka2pc.aio import AsyncTwoPhaseCommitProducer

try:  # SQLAlchemy 2.1 (``await_only`` is its old name, deprecated from 2.2 on)
    from sqlalchemy.util import await_ as _await
except ImportError:  # pragma: no cover - SQLAlchemy 2.0
    from sqlalchemy.util import await_only as _await

__all__ = ["OffLoop", "in_greenlet", "run_to_completion", "wait_for"]

logger = logging.getLogger("kafka2pc.recipes.dual_write.aio")

_T = TypeVar("_T")


def wait_for(awaitable: Awaitable[_T]) -> _T:
    """Inside the recipe's greenlet: let the loop await ``awaitable``, return its result."""
    return _await(awaitable)


async def in_greenlet(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """Run the sync ``fn`` on the loop's thread; where it waits (:func:`wait_for`), the loop runs on."""
    return await greenlet_spawn(fn, *args, **kwargs)


async def run_to_completion(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """:func:`in_greenlet`, in a task of its own that a cancellation of the caller does not interrupt.

    A step of the recipe (a commit, a rollback and abort, a recovery) runs to
    its end even when the caller's task is cancelled (a client went away, a
    timeout fired): the writer's state then reflects its outcome, exactly as
    if the caller had waited, and the next transaction starts from there.
    The caller gets its :class:`asyncio.CancelledError` once the step ended.
    """
    task = asyncio.ensure_future(greenlet_spawn(fn, *args, **kwargs))
    interrupted = False
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            interrupted = True
    if interrupted:
        if not task.cancelled() and task.exception() is not None:
            logger.info("a dual-write step whose caller was cancelled raised %r (the writer's state reflects it)",
                        task.exception())
        raise asyncio.CancelledError
    return task.result()


class OffLoop:
    """A thread per call for the few blocking calls that are neither producer nor database calls.

    They are rare (a topic's first metadata request, a recovery plan after a
    heuristic outcome, a fenced commit's outcome): a short-lived thread each,
    so that an idle writer holds no thread beyond its producer's.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def run(self, call: Callable[[], _T]) -> _T:
        """Inside the recipe's greenlet: run ``call`` in a thread of its own, the loop running meanwhile."""
        executor = ThreadPoolExecutor(1, thread_name_prefix=self._name)
        try:
            return wait_for(asyncio.get_running_loop().run_in_executor(executor, call))
        finally:
            executor.shutdown(wait=False)


class _GreenletProducer:
    """The :class:`kafka2pc.TwoPhaseCommitProducer` methods the recipe calls, answered by an async producer.

    Called from the recipe's greenlet only: each method hands the async
    producer's coroutine to the loop and returns its result (or raises its
    error, the same classes as the sync producer's).
    """

    def __init__(self, producer: AsyncTwoPhaseCommitProducer) -> None:
        self.async_producer = producer

    # -- read-only state (no I/O) ---------------------------------------------------
    @property
    def transactional_id(self) -> str:
        return self.async_producer.transactional_id

    @property
    def state(self) -> TxnState:
        return self.async_producer.state

    @property
    def prepared_state(self) -> PreparedTxnState | None:
        return self.async_producer.prepared_state

    @property
    def last_settlement(self) -> Settlement | None:
        return self.async_producer.last_settlement

    @property
    def control_plane(self) -> Any:
        # Used by the recipe only inside the runtime's blocking(), i.e. in the helper thread.
        return self.async_producer.sync_producer.control_plane

    def __len__(self) -> int:
        return len(self.async_producer)

    # -- calls ----------------------------------------------------------------------
    def init_transactions(self, timeout: float | None = None, *, keep_prepared_txn: bool = False) -> None:
        wait_for(self.async_producer.init_transactions(timeout, keep_prepared_txn=keep_prepared_txn))

    def begin_transaction(self) -> None:
        wait_for(self.async_producer.begin_transaction())

    def produce(self, topic: str, **kwargs: Any) -> None:
        on_delivery: Callable[[Any, Any], None] | None = kwargs.pop("on_delivery", None)
        delivered = wait_for(self.async_producer.produce(topic, **kwargs))
        if on_delivery is not None:
            def report(future: asyncio.Future[Any]) -> None:
                if future.cancelled():
                    return
                error = future.exception()
                on_delivery(error, None if error is not None else future.result())

            delivered.add_done_callback(report)

    def poll(self, timeout: float = 0.0) -> int:
        # The async producer's thread serves delivery reports by itself: waiting is all that is left.
        wait_for(asyncio.sleep(timeout))
        return 0

    def send_offsets_to_transaction(
        self, offsets: list[Any], group_metadata: Any, timeout: float | None = None
    ) -> None:
        wait_for(self.async_producer.send_offsets_to_transaction(offsets, group_metadata, timeout))

    def prepare_transaction(self, timeout: float | None = None) -> PreparedTxnState:
        return wait_for(self.async_producer.prepare_transaction(timeout))

    def commit_transaction(self, timeout: float | None = None) -> None:
        wait_for(self.async_producer.commit_transaction(timeout))

    def abort_transaction(self, timeout: float | None = None) -> None:
        wait_for(self.async_producer.abort_transaction(timeout))

    def complete_transaction(self, state: PreparedTxnState, timeout: float | None = None) -> None:
        wait_for(self.async_producer.complete_transaction(state, timeout))

    def close(self, timeout: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        wait_for(self.async_producer.close(timeout))
