"""The one seam between the dual write and how it waits: threads (:data:`THREADS`) or an event loop.

The writer, the pool and the pipelined commit are written once, as sync
code.  Everything in them that waits, or that runs something in the
background, asks the :class:`Runtime` they were given: a new producer, a
pause, a blocking call that is neither a producer nor a database call,
a condition, an event, a semaphore, workers for background commits,
background loops, and running one call per item ``n`` at a time.

:class:`Threads` answers with the :mod:`threading` module (the sync
recipe); ``recipes/dual_write/aio/_runtime.py``'s ``EventLoop`` answers with
the running asyncio loop, the recipe's code running in SQLAlchemy's greenlet
bridge (httpx's ``HTTPTransport`` / ``AsyncHTTPTransport`` split, for a
recipe instead of a client).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from types import TracebackType

    from kafka2pc import PreparedTxnState, Settlement, TransactionDescription, TwoPhaseCommitProducer

__all__ = ["THREADS", "Admin", "Admins", "Background", "Condition", "Event", "Runtime", "Semaphore", "Threads",
           "Workers",
           "fork_lock", "forks_seen",
           "keep_inherited"]

_T = TypeVar("_T")
_I = TypeVar("_I")


class Event(Protocol):
    """:class:`threading.Event`'s part the recipe uses."""

    def is_set(self) -> bool: ...
    def set(self) -> None: ...
    def wait(self, timeout: float | None = None) -> bool: ...


class Condition(Protocol):
    """:class:`threading.Condition`'s part the recipe uses (held only for in-memory work)."""

    def __enter__(self) -> bool: ...
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None, /) -> None: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    def notify(self, n: int = 1) -> None: ...
    def notify_all(self) -> None: ...


class Semaphore(Protocol):
    """:class:`threading.BoundedSemaphore`'s ``acquire`` and ``release``."""

    def acquire(self) -> bool: ...
    def release(self) -> None: ...


class Workers(Protocol):
    """Where background calls run (the pipelined commits)."""

    def spawn(self, run: Callable[[], None]) -> None: ...
    def close(self) -> None: ...


class Background(Protocol):
    """Loops running in the background (the pool's renewal and orphan scan)."""

    def join(self, deadline: float) -> None:
        """Wait until ``deadline`` (a ``time.monotonic()`` value) for the loops to end."""


class Admin(Protocol):
    """The :class:`~kafka2pc.TransactionAdmin` calls the orphan scan settles an id with."""

    def complete_transaction(self, transactional_id: str, state: PreparedTxnState, *, fence: bool = True,
                             on_heuristic: Any = "raise") -> Settlement: ...
    def force_terminate_transaction(self, transactional_id: str) -> TransactionDescription | None: ...


class Admins(Protocol):
    """One admin per settling thread or task (a control plane serves one at a time), closed together."""

    def get(self) -> Admin: ...
    def close(self) -> None: ...


class Runtime(Protocol):
    """What the dual write waits with: threads or an event loop (see the module docstring)."""

    def new_producer(self, config: Mapping[str, Any]) -> TwoPhaseCommitProducer:
        """A producer for ``config`` (each recovery makes one)."""

    def pause(self, seconds: float) -> None:
        """Wait ``seconds`` (between two attempts)."""

    def blocking(self, call: Callable[[], _T]) -> _T:
        """Run a call that waits on the network but on neither the producer nor the database."""

    def condition(self) -> Condition: ...
    def event(self) -> Event: ...
    def semaphore(self, value: int) -> Semaphore: ...

    def workers(self, max_workers: int, name: str) -> Workers:
        """Up to ``max_workers`` background calls at once."""

    def background(self, loops: Iterable[tuple[str, Callable[[], None]]]) -> Background:
        """Start each ``(name, loop)`` in the background (a thread of that name, or a task of the loop)."""

    def run_each(self, call: Callable[[_I], _T], items: list[_I], parallelism: int, name: str) -> list[_T]:
        """``call`` on every item, ``parallelism`` at a time; every call ends, then the first error is raised."""

    def admins(self, config: Mapping[str, Any]) -> Admins: ...


class _ThreadAdmins:
    """One :class:`~kafka2pc.TransactionAdmin` per settling thread (a control plane serves one thread)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = config
        self._local = threading.local()
        self._all: list[Any] = []
        self._lock = threading.Lock()

    def get(self) -> Admin:
        admin: Any = getattr(self._local, "admin", None)
        if admin is None:
            from kafka2pc import TransactionAdmin

            admin = TransactionAdmin(self._config)
            self._local.admin = admin
            with self._lock:
                self._all.append(admin)
        return admin  # type: ignore[no-any-return]

    def close(self) -> None:
        with self._lock:
            admins, self._all = self._all, []
        for admin in admins:
            admin.close()


class _ThreadWorkers:
    def __init__(self, max_workers: int, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix=name)

    def spawn(self, run: Callable[[], None]) -> None:
        self._executor.submit(run)

    def close(self) -> None:
        self._executor.shutdown(wait=False)


class _Threads:
    def __init__(self, threads: list[threading.Thread]) -> None:
        self._threads = threads

    def join(self, deadline: float) -> None:
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


class Threads:
    """The sync recipe's runtime: :mod:`threading`, ``time.sleep`` and calls made in the caller's thread."""

    def new_producer(self, config: Mapping[str, Any]) -> TwoPhaseCommitProducer:
        from kafka2pc import TwoPhaseCommitProducer

        return TwoPhaseCommitProducer(dict(config))

    def pause(self, seconds: float) -> None:
        time.sleep(seconds)

    def blocking(self, call: Callable[[], _T]) -> _T:
        return call()

    def condition(self) -> Condition:
        return threading.Condition()

    def event(self) -> Event:
        return threading.Event()

    def semaphore(self, value: int) -> Semaphore:
        return threading.BoundedSemaphore(value)

    def workers(self, max_workers: int, name: str) -> Workers:
        return _ThreadWorkers(max_workers, name)

    def background(self, loops: Iterable[tuple[str, Callable[[], None]]]) -> Background:
        threads = [threading.Thread(target=loop, name=name, daemon=True) for name, loop in loops]
        for thread in threads:
            thread.start()
        return _Threads(threads)

    def run_each(self, call: Callable[[_I], _T], items: list[_I], parallelism: int, name: str) -> list[_T]:
        if len(items) == 1 or parallelism == 1:
            return [call(item) for item in items]
        with ThreadPoolExecutor(min(parallelism, len(items)), thread_name_prefix=name) as executor:
            return list(executor.map(call, items))

    def admins(self, config: Mapping[str, Any]) -> Admins:
        return _ThreadAdmins(config)


THREADS: Threads = Threads()
"""The runtime of :class:`DualWriter` and :class:`WriterPool` (stateless: one for all)."""


_forks = 0
_fork_lock = threading.Lock()
_inherited: list[object] = []


def _forked() -> None:
    global _forks, _fork_lock
    _forks += 1
    _fork_lock = threading.Lock()  # the parent's may have been held by a thread that is not in the child


os.register_at_fork(after_in_child=_forked)


def forks_seen() -> int:
    """How many forks led to this process (0 in the process that started).

    An object that remembers this value when it is made knows it was
    inherited through ``fork()`` when it differs: a comparison, no system
    call, on every use.
    """
    return _forks


def fork_lock() -> threading.Lock:
    """A lock for remaking an object in a forked child (made anew in each child, never inherited held)."""
    return _fork_lock


def keep_inherited(*objects: object) -> None:
    """Keep what a forked child inherited and will not use (the parent's producers, threads' objects)
    referenced for the child's life: freeing a librdkafka handle whose threads are not in this process
    blocks for a while (librdkafka waits for them), and nothing in the child needs them freed."""
    _inherited.extend(objects)
