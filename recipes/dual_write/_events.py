"""The events a writer and a pool declare, and the listeners attached to them (SQLAlchemy's event model).

A :class:`DualWriter`, a :class:`WriterPool` and their asyncio twins declare
their events in :data:`EVENTS`; a listener attaches with ``add_listener(event,
fn)`` and detaches with ``remove_listener(event, fn)``.  The one event so far:

``"step"``
    ``fn(writer, step)`` at every :class:`Step` of the normal and recovery
    paths, in the thread (or task) running them.  ``writer`` is the
    :class:`DualWriter` that reached the step: for a pool, the slot's writer;
    for an asyncio twin, the writer running its code.  An exception a
    listener raises before the database commit rolls the transaction back
    (as ``on_step``'s does).  ``on_step=`` is the same event for a
    one-argument callable, called after the listeners.

:mod:`kafka2pc.otel` instruments writers and pools through this API only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Final

from kafka2pc import UsageError

from ._values import Step, StepHook

__all__ = ["EVENTS", "Listeners", "StepListener"]

StepListener = Callable[[Any, Step], None]
"""A ``"step"`` listener: called with ``(writer, step)`` (see :data:`EVENTS`)."""

EVENTS: Final = frozenset({"step"})
"""The events of writers and pools (see the module docstring)."""


class Listeners:
    """The listeners of one writer (or one pool, for all its writers), fired by the owner only.

    A writer of a pool fires its pool's listeners first, then its own, then ``on_step``.
    """

    def __init__(self, on_step: StepHook | None = None, parent: Listeners | None = None) -> None:
        self.on_step = on_step
        self._parent = parent
        self._step: list[StepListener] = []
        self._source: weakref.ref[Any] | None = None

    def bind(self, source: object) -> None:
        """Name the object the listeners are told about (the writer; held weakly)."""
        self._source = weakref.ref(source)

    @property
    def active(self) -> bool:
        """Anyone listening (a writer skips building a step nobody hears)."""
        return bool(self._step) or self.on_step is not None or (self._parent is not None and self._parent.active)

    def add(self, event: str, fn: StepListener, *, first: bool = False) -> None:
        """Attach ``fn`` to ``event`` (``first``: before the listeners already attached)."""
        self._check(event, fn)
        if first:
            self._step.insert(0, fn)
        else:
            self._step.append(fn)

    def remove(self, event: str, fn: StepListener) -> None:
        """Detach ``fn`` from ``event``; :class:`~kafka2pc.UsageError` if it was not attached."""
        self._check(event, fn)
        try:
            self._step.remove(fn)
        except ValueError:
            raise UsageError(f"remove_listener({event!r}, {fn!r}): it is not attached") from None

    @staticmethod
    def _check(event: str, fn: object) -> None:
        if event not in EVENTS:
            raise UsageError(f"unknown event {event!r}; the events are {sorted(EVENTS)}")
        if not callable(fn):
            raise UsageError(f"a listener must be callable, not {type(fn).__name__}")

    def fire_step(self, step: Step) -> None:
        """Call every ``"step"`` listener, then ``on_step``."""
        parent = self._parent
        if self._step or (parent is not None and parent._step):
            source = self._source() if self._source is not None else None
            if parent is not None:
                for listener in list(parent._step):
                    listener(source, step)
            for listener in list(self._step):
                listener(source, step)
        if self.on_step is not None:
            self.on_step(step)
