"""One dedicated thread per client: blocking calls run there, in submission order, off the event loop.

Why one thread per producer rather than a shared pool: librdkafka's
transactional API is a sequence (begin, produce, flush, commit) whose order is
the contract, and kafka2pc's state machine assumes one caller at a time.  A
single thread keeps both without a lock, and it gives delivery reports a home:
when no call is queued and records are in flight, the thread serves them with
``poll(0)`` (see :class:`SerialWorker`'s ``idle``).

Results travel back with ``loop.call_soon_threadsafe``: nothing here ever
blocks the loop's thread.  A caller that stops waiting (its task was
cancelled) does not stop the call: it runs to completion, and its effect is
what the next call sees.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Final, TypeVar

__all__ = ["SerialWorker"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_STOP: Final = object()
_WAKE: Final = object()


class SerialWorker:
    """A daemon thread that runs submitted callables one at a time, in order.

    ``idle`` (optional) returns True while it wants to be called again soon
    (records awaiting delivery reports); the thread then calls ``serve`` every
    ``idle_interval`` seconds while its queue is empty (``serve`` hands its
    own results to the loop).  ``after_call`` runs in the thread after each
    call and may return a function to run on the loop (batched delivery
    reports): it travels in the same ``call_soon_threadsafe`` as the call's
    result and runs just before it, so one wake-up of the loop carries both,
    in order.
    """

    def __init__(
        self,
        name: str,
        *,
        idle: Callable[[], bool] | None = None,
        serve: Callable[[], object] | None = None,
        after_call: Callable[[], Callable[[], None] | None] | None = None,
        idle_interval: float = 0.005,
    ) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._idle = idle
        self._serve = serve
        self._after_call = after_call
        self._idle_interval = idle_interval
        self._stopped = False
        self._sleeping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The worker thread (calls run there, never on the loop)."""
        return self._thread

    def submit(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[[], _T], done: Callable[[], None]
    ) -> asyncio.Future[_T]:
        """Queue ``fn``; return a loop future for its result.

        ``done`` runs on the loop thread once ``fn`` has finished, whether or
        not anyone still awaits the future (bookkeeping of calls in flight).
        """
        if self._stopped:
            raise RuntimeError("the worker thread has stopped")
        future: asyncio.Future[_T] = loop.create_future()
        # The call runs in the caller's context (contextvars): an OpenTelemetry span current in the
        # awaiting task is the parent of the spans the call starts, as it would be in a sync call.
        self._queue.put((loop, future, functools.partial(contextvars.copy_context().run, fn), done))
        return future

    def wake(self) -> None:
        """Tell a thread that sleeps without a timeout to ask ``idle`` again (records were just queued)."""
        if self._sleeping:
            self._sleeping = False
            self._queue.put(_WAKE)

    def stop(self) -> None:
        """Let the thread finish the queued calls and exit (does not wait)."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(_STOP)

    def _run(self) -> None:
        while True:
            # "sleeping" is set before idle() is asked: a wake() racing with the
            # question either sees the flag or queued its records before idle() looked.
            self._sleeping = True
            wants_serving = self._idle is not None and self._idle()
            if wants_serving:
                self._sleeping = False
            try:
                item = self._queue.get(timeout=self._idle_interval if wants_serving else None)
            except queue.Empty:
                self._serve_now()
                continue
            finally:
                self._sleeping = False
            if item is _WAKE:
                continue
            if item is _STOP:
                return
            loop, future, fn, done = item
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                error = exc
            before = self._after_call() if self._after_call is not None else None
            try:
                loop.call_soon_threadsafe(_resolve, future, result, error, done, before)
            except RuntimeError:  # the loop is closed: nobody is left to tell
                logger.debug("%s: loop closed before a result could be delivered", self._thread.name)

    def _serve_now(self) -> None:
        if self._serve is None:
            return
        try:
            self._serve()
        except Exception:  # noqa: BLE001 - the next call reports the producer's error
            logger.debug("%s: serving delivery reports failed", self._thread.name, exc_info=True)


def _resolve(
    future: asyncio.Future[Any],
    result: Any,
    error: BaseException | None,
    done: Callable[[], None],
    before: Callable[[], None] | None,
) -> None:
    if before is not None:
        before()
    done()
    if future.cancelled():
        if error is not None:
            logger.info("a call whose caller stopped waiting raised %r (the state reflects it)", error)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
