"""The asyncio twins' runtime: the sync recipe's waits answered by the running event loop.

:class:`EventLoop` is the other implementation of the recipe's one seam
(``recipes/dual_write/_runtime.py``).  The writer's and the pool's code runs
unchanged in SQLAlchemy's greenlet bridge (see ``_bridge.py``); what would
block answers through the loop instead:

* the producer is an :class:`~kafka2pc.aio.AsyncTwoPhaseCommitProducer`
  (one thread of its own), called through :class:`_GreenletProducer`;
* a pause is an ``asyncio.sleep``; a blocking call that is neither a
  producer nor a database call runs in a short-lived thread (:class:`OffLoop`);
* the pool's condition, stop signal and the pipeline's places are futures of
  the loop (:class:`_LoopCondition`, :class:`_LoopEvent`,
  :class:`_LoopSemaphore`); the pool's lock is only ever held for in-memory
  work, between two waits, so the loop's single thread is all the exclusion
  it needs;
* the renewal, the orphan scan, the settlers and the pipelined commits are
  tasks of the loop, not threads; each settling task has an
  :class:`~kafka2pc.aio.AsyncTransactionAdmin` of its own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from kafka2pc.aio import AsyncTransactionAdmin, AsyncTwoPhaseCommitProducer

from ._bridge import OffLoop, _GreenletProducer, current_scope, in_greenlet, wait_for

if TYPE_CHECKING:
    from kafka2pc import PreparedTxnState, Settlement, TransactionDescription, TwoPhaseCommitProducer

    from .._runtime import Admin, Admins, Background, Condition, Event, Semaphore, Workers

__all__ = ["EVENT_LOOP", "EventLoop"]

logger = logging.getLogger("kafka2pc.recipes.dual_write.aio._pool")

_T = TypeVar("_T")
_I = TypeVar("_I")


class _LoopCondition:
    """:class:`threading.Condition`'s interface for code running in greenlets on one loop's thread.

    Entering it takes nothing: the code inside never switches greenlets
    except in :meth:`wait`, so no other task runs in between.
    """

    def __init__(self) -> None:
        self._waiters: collections.deque[asyncio.Future[bool]] = collections.deque()

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc_info: object) -> None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        """Inside the pool's greenlet: let the loop run until :meth:`notify` (True) or ``timeout`` (False)."""
        _before_waiting()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()  # True once notified, False at the timeout
        self._waiters.append(waiter)
        timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
        notified = False
        try:
            notified = wait_for(waiter)
            return notified
        finally:
            if timer is not None:
                timer.cancel()
            if not notified:
                with contextlib.suppress(ValueError):  # notify() may have taken it out, done, and passed it by
                    self._waiters.remove(waiter)

    def notify(self, n: int = 1) -> None:
        """Wake up to ``n`` waiters."""
        while n > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                n -= 1

    def notify_all(self) -> None:
        """Wake every waiter."""
        self.notify(len(self._waiters))


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


class _LoopEvent:
    """:class:`threading.Event`'s interface over an :class:`asyncio.Event` (``wait`` from a greenlet)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Inside the pool's greenlet: True once set, False after ``timeout``."""
        if not self._event.is_set():
            _before_waiting()
            waiter = asyncio.ensure_future(self._event.wait())
            try:
                wait_for(asyncio.wait({waiter}, timeout=timeout))
            finally:
                waiter.cancel()
        return self._event.is_set()


class _LoopSemaphore:
    """:class:`threading.BoundedSemaphore`'s ``acquire``/``release`` for the pool's greenlets."""

    def __init__(self, value: int) -> None:
        self._semaphore = asyncio.BoundedSemaphore(value)

    def acquire(self) -> bool:
        """Inside a greenlet: take a free place at once, else let the loop run until one is free."""
        if not self._semaphore.locked():
            # A free place is taken without suspending (asyncio's acquire() returns before its first
            # await): no switch to the loop and back, which every pipelined commit would otherwise pay.
            attempt = self._semaphore.acquire()
            try:
                attempt.send(None)
            except StopIteration as done:
                return bool(done.value)
            attempt.close()  # pragma: no cover - it suspended after all: undo, and wait as below
        _before_waiting()
        return wait_for(self._semaphore.acquire())

    def release(self) -> None:
        self._semaphore.release()


class _LoopWorkers:
    """Background calls as tasks of the loop (a greenlet each)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, run: Callable[[], None]) -> None:
        scope = current_scope()
        if scope is not None and scope.defer(run):
            # A pipelined commit deferred by a transaction's scope: its own task runs it once the caller
            # was answered (no task and greenlet more per transaction).
            return
        task = asyncio.ensure_future(in_greenlet(run))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        return None


class _LoopBackground:
    def __init__(self, tasks: list[asyncio.Task[None]]) -> None:
        self._tasks = tasks

    def join(self, deadline: float) -> None:
        if not self._tasks:
            return
        _, pending = wait_for(asyncio.wait(self._tasks, timeout=max(0.0, deadline - time.monotonic())))
        for task in pending:
            logger.warning("a background task of a pool did not end in time: cancelling it")
            task.cancel()


class _GreenletAdmin:
    """The :class:`~kafka2pc.TransactionAdmin` calls the pool settles orphans with, answered by an async admin."""

    def __init__(self, admin: AsyncTransactionAdmin) -> None:
        self._admin = admin

    def complete_transaction(
        self, transactional_id: str, state: PreparedTxnState, *, fence: bool = True,
        on_heuristic: Literal["raise", "report"] = "raise",
    ) -> Settlement:
        return wait_for(self._admin.complete_transaction(
            transactional_id, state, fence=fence, on_heuristic=on_heuristic))

    def force_terminate_transaction(self, transactional_id: str) -> TransactionDescription | None:
        return wait_for(self._admin.force_terminate_transaction(transactional_id))


class _LoopAdmins:
    """One :class:`~kafka2pc.aio.AsyncTransactionAdmin` (one thread) per settling task."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = config
        self._by_task: dict[asyncio.Task[Any] | None, AsyncTransactionAdmin] = {}

    def get(self) -> Admin:
        task = asyncio.current_task()
        admin = self._by_task.get(task)
        if admin is None:
            admin = self._by_task[task] = AsyncTransactionAdmin(dict(self._config))
        return _GreenletAdmin(admin)

    def close(self) -> None:
        admins, self._by_task = list(self._by_task.values()), {}
        for admin in admins:
            wait_for(admin.close())


def _before_waiting() -> None:
    """Inside a greenlet about to wait: start the calls its scope deferred (the wait may be for one of them)."""
    scope = current_scope()
    if scope is not None:
        scope.start_deferred()


class EventLoop:
    """The runtime of the asyncio twins: the running loop, the recipe's code in its greenlet bridge."""

    def __init__(self) -> None:
        self._off_loop = OffLoop("kafka2pc-aio-offloop")

    def new_producer(self, config: Mapping[str, Any]) -> TwoPhaseCommitProducer:
        # A full local queue raises at once: the recipe's own loop waits (poll = asyncio.sleep) up to its limit.
        producer = AsyncTwoPhaseCommitProducer(dict(config), queue_full_timeout_s=0.0)
        return cast("TwoPhaseCommitProducer", _GreenletProducer(producer))

    def pause(self, seconds: float) -> None:
        wait_for(asyncio.sleep(seconds))

    def blocking(self, call: Callable[[], _T]) -> _T:
        return self._off_loop.run(call)

    def condition(self) -> Condition:
        return _LoopCondition()

    def event(self) -> Event:
        return _LoopEvent()

    def semaphore(self, value: int) -> Semaphore:
        return _LoopSemaphore(value)

    def workers(self, max_workers: int, name: str) -> Workers:
        return _LoopWorkers()

    def background(self, loops: Iterable[tuple[str, Callable[[], None]]]) -> Background:
        return _LoopBackground([asyncio.ensure_future(in_greenlet(loop)) for _, loop in loops])

    def run_each(self, call: Callable[[_I], _T], items: list[_I], parallelism: int, name: str) -> list[_T]:
        if len(items) == 1 or parallelism == 1:
            return [call(item) for item in items]
        found: list[Any] = [None] * len(items)
        todo = iter(enumerate(items))

        async def settler() -> None:
            for i, item in todo:  # the settlers share one iterator: each item is done once
                found[i] = await in_greenlet(call, item)

        n = min(parallelism, len(items))
        errors = wait_for(asyncio.gather(*(settler() for _ in range(n)), return_exceptions=True))
        for error in errors:  # as the thread runtime's executor: every settler ends, then the first error is raised
            if isinstance(error, BaseException):
                raise error
        return found

    def admins(self, config: Mapping[str, Any]) -> Admins:
        return _LoopAdmins(config)


EVENT_LOOP: EventLoop = EventLoop()
"""The runtime of :class:`AsyncDualWriter` and :class:`AsyncWriterPool` (stateless: one for all)."""
