"""Fork detection: an object used in a process other than the one that made it raises at once.

confluent-kafka's producers, kafka-python's connections and the threads behind
them do not survive ``fork()``: in the child, the librdkafka producer's
threads are gone and its sockets are shared with the parent, so a call waits
for an answer that never comes, or mixes its requests with the parent's.  A
:class:`~kafka2pc.TwoPhaseCommitProducer` cannot be remade transparently
either: a new instance with the same ``transactional.id`` would fence the
parent's.  So every object that holds such parts takes a :class:`ForkGuard`
when it is made and checks it at each public entry: in a forked child the
check raises :class:`~kafka2pc.ForkedProcessError` before anything is sent.

The check costs one attribute read: every guard registers in a weak set,
and ``os.register_at_fork`` marks each one ``forked`` in the child, right
after the fork (never in the parent).  A guard also keeps the process id of
its maker, for the message.
"""

from __future__ import annotations

import os
import weakref

from kafka2pc._exceptions import ForkedProcessError

__all__ = ["ForkGuard", "abandon"]

_guards: weakref.WeakSet[ForkGuard] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for guard in list(_guards):
        guard.forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


class ForkGuard:
    """Remembers the process that made an object; :meth:`check` raises in any other one (a forked child)."""

    __slots__ = ("__weakref__", "_pid", "_what", "forked")

    def __init__(self, what: str) -> None:
        self._what = what
        self._pid = os.getpid()
        self.forked = False
        """Whether this process is a child forked after the object was made (set by the fork hook only)."""
        _guards.add(self)

    @property
    def pid(self) -> int:
        """The process id of the process that made the object."""
        return self._pid

    def check(self) -> None:
        """Raise :meth:`error` if :attr:`forked`; return at once otherwise."""
        if self.forked:
            raise self.error()

    def error(self) -> ForkedProcessError:
        """The :class:`~kafka2pc.ForkedProcessError` a call in a forked child raises."""
        return ForkedProcessError(
            f"{self._what} was made in process {self._pid} and is used in process {os.getpid()}, a child "
            f"forked after it was made: its connections and threads did not survive the fork, and a new "
            f"instance would fence the parent's. Nothing was sent. Create it after the fork, in the process "
            f"that uses it (gunicorn's post_worker_init hook, Celery's worker_process_init signal, uWSGI's postfork)",
            pid=self._pid,
        )


_abandoned: list[object] = []


def abandon(*parts: object) -> None:
    """Keep ``parts`` (inherited from the parent through a fork) alive, untouched, until this process ends.

    A librdkafka handle destroyed in a forked child waits for threads that
    live only in the parent (its destructor joins them) and would hang the
    child; closing an inherited kafka-python client would do the same with
    its IO thread.  Abandoned parts are never closed, flushed or destroyed
    in the child: an extra reference (which interpreter shutdown does not
    drop) keeps their destructors from running, and their sockets close when
    the child exits.  The parent's own objects are not touched.
    """
    import ctypes

    for part in parts:
        if part is None:
            continue
        _abandoned.append(part)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(part))
