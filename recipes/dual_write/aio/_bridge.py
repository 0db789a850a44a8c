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
import contextvars
import logging
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar, cast

from sqlalchemy.util import greenlet_spawn

from kafka2pc import DEFAULT_CLOSE_TIMEOUT_S, PreparedTxnState, Settlement, TxnState
from kafka2pc.aio import AsyncTwoPhaseCommitProducer

try:  # SQLAlchemy 2.1 (``await_only`` is its old name, deprecated from 2.2 on)
    from sqlalchemy.util import await_ as _await
except ImportError:  # pragma: no cover - SQLAlchemy 2.0
    from sqlalchemy.util import await_only as _await

__all__ = ["OffLoop", "ScopeRun", "current_scope", "in_greenlet", "run_to_completion", "wait_for"]

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


class ScopeRun(Generic[_T]):
    """A sync scope (a writer's or a pool's transaction) as an async context manager, run by one task of its own.

    One task and one greenlet per transaction: the task enters the scope,
    hands the handle over, waits for the outcome of the caller's block, then
    leaves the scope with it (an exception of the block goes to the scope,
    which rolls back both sides and re-raises it) and runs the calls the
    scope deferred to the background (the pipelined Kafka commit, see
    :meth:`defer`) once the caller was answered.  A cancellation of the caller
    interrupts neither step: as :func:`run_to_completion`, the caller gets its
    :class:`asyncio.CancelledError` once the step ended.  A caller cancelled
    while the scope was being entered gets it after the scope was left the
    same way (with that :class:`asyncio.CancelledError`): nothing entered
    stays held.
    """

    __slots__ = ("_after", "_entered", "_left", "_left_signal", "_outcome", "_scope")

    def __init__(self, scope: AbstractContextManager[_T]) -> None:
        loop = asyncio.get_running_loop()
        self._scope = scope
        # The handle, or the error entering raised; cancelled by a cancellation of the caller, which tells
        # the task that nobody takes the handle (the caller then waits for the scope to be left).
        self._entered: asyncio.Future[_T] = loop.create_future()
        self._outcome: asyncio.Future[BaseException | None] = loop.create_future()
        self._left: tuple[bool, Any] | None = None  # (True, suppressed) or (False, the error leaving raised)
        self._left_signal: asyncio.Future[None] = loop.create_future()
        self._after: list[Callable[[], None]] | None = None

    async def __aenter__(self) -> _T:
        task = asyncio.get_running_loop().create_task(greenlet_spawn(self._run))
        _SCOPE_TASKS.add(task)  # the loop keeps weak references only; the task outlives its caller's wait
        task.add_done_callback(_SCOPE_TASKS.discard)
        entered = self._entered
        try:
            return await entered
        except BaseException as exc:
            if not entered.cancelled() and entered.exception() is not None:
                raise  # entering failed (or failed and the caller was cancelled meanwhile): nothing is held
            # The caller was cancelled while the scope was being entered: leave it (rolls back both sides).
            await self._leave(exc)
            raise

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool:
        return await self._leave(exc)

    async def _leave(self, exc: BaseException | None) -> bool:
        """Tell the task how the block ended (``exc``: its exception, or ``None``); wait until it left the scope.

        Returns whether the scope suppressed ``exc``; raises what leaving
        raised.  A cancellation of the caller while it waits does not
        interrupt the exit: :class:`asyncio.CancelledError` follows it.
        """
        if not self._outcome.done():  # (cancelled if the task itself was cancelled: it left with that)
            self._outcome.set_result(exc)
        interrupted = False
        while self._left is None:
            try:
                await self._left_signal
            except asyncio.CancelledError:
                interrupted = True
                if self._left_signal.cancelled():
                    self._left_signal = asyncio.get_running_loop().create_future()
        ok, value = self._left
        if interrupted:
            if not ok:
                logger.info("leaving a dual-write scope whose caller was cancelled raised %r "
                            "(the writer's state reflects it)", value)
            raise asyncio.CancelledError
        if not ok:
            raise value
        return bool(value)

    def defer(self, call: Callable[[], None]) -> bool:
        """Inside the task, while it leaves the scope: run ``call`` once the caller was answered (True).

        False once the task no longer takes calls (they then need a task of their own).
        """
        if self._after is None:
            return False
        self._after.append(call)
        return True

    def start_deferred(self) -> None:
        """Before the task waits for something a deferred call may be the one to end: start them in tasks now."""
        after, self._after = self._after, None
        for call in after or ():
            _spawn(call)

    # -- in the task's greenlet ------------------------------------------------------
    def _run(self) -> None:
        _CURRENT_SCOPE.set(self)  # in this task's context only (the caller's block runs in its own)
        try:
            handle = self._scope.__enter__()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            if self._entered.cancelled():  # the caller stopped waiting for the handle: it waits in _leave()
                logger.info("entering a dual-write scope whose caller was cancelled raised %r", exc)
                self._answer(True, False)
            else:
                self._entered.set_exception(exc)
            return
        if not self._entered.cancelled():
            self._entered.set_result(handle)
        outcome: BaseException | None
        try:
            outcome = wait_for(self._outcome)
        except BaseException as interrupted:  # noqa: BLE001 - this task was cancelled (the loop is closing)
            outcome = interrupted
        self._after = []
        try:
            if outcome is None:
                suppressed = self._scope.__exit__(None, None, None)
            else:
                suppressed = self._scope.__exit__(type(outcome), outcome, outcome.__traceback__)
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            self._answer(False, error)
        else:
            self._answer(True, suppressed)
        after, self._after = self._after, None
        for call in after or ():
            try:
                call()
            except Exception:  # noqa: BLE001 - as in a task of its own: logged, the others still run
                logger.exception("a call a dual-write scope deferred failed")

    def _answer(self, ok: bool, value: Any) -> None:
        self._left = (ok, value)
        if not self._left_signal.done():
            self._left_signal.set_result(None)


_CURRENT_SCOPE: contextvars.ContextVar[ScopeRun[Any] | None] = contextvars.ContextVar("kafka2pc_aio_scope")
_SCOPE_TASKS: set[asyncio.Task[Any]] = set()


def current_scope() -> ScopeRun[Any] | None:
    """The :class:`ScopeRun` whose task runs the calling code, if any."""
    return _CURRENT_SCOPE.get(None)


def _spawn(call: Callable[[], None]) -> None:
    """Run the sync ``call`` in a task of its own (kept referenced until it ends), outside any scope."""

    def run() -> None:
        _CURRENT_SCOPE.set(None)  # in the new task's copy of the context: the scope's own is untouched
        call()

    task = asyncio.ensure_future(greenlet_spawn(run))
    _SCOPE_TASKS.add(task)
    task.add_done_callback(_SCOPE_TASKS.discard)


def _now_or_wait(coroutine: Coroutine[Any, Any, _T]) -> _T:
    """Inside the recipe's greenlet: run ``coroutine`` here if it ends without waiting, else let the loop finish it.

    For a call that hardly ever waits (an async produce: librdkafka queues
    the record at once): no switch to the loop and back when it does not.
    """
    try:
        pending = coroutine.send(None)
    except StopIteration as done:
        return cast("_T", done.value)
    return wait_for(_resumed(coroutine, pending))


@types.coroutine
def _resumed(coroutine: Coroutine[Any, Any, _T], pending: Any) -> Generator[Any, Any, _T]:
    """The rest of ``coroutine``, started by hand and suspended on ``pending``, as an awaitable (``yield from``)."""
    while True:
        try:
            sent = yield pending
        except BaseException as exc:  # noqa: BLE001 - thrown into the coroutine, as yield from does
            try:
                pending = coroutine.throw(exc)
            except StopIteration as done:
                return cast("_T", done.value)
        else:
            try:
                pending = coroutine.send(sent)
            except StopIteration as done:
                return cast("_T", done.value)


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
        delivered = _now_or_wait(self.async_producer.produce(topic, **kwargs))
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
