"""``LoopStallMonitor``: how long the event loop was unable to run anything, as the loop sees it."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from kafka2pc._deprecation import deprecated_alias, deprecated_property, renamed, renamed_argument

__all__ = ["LoopStallMonitor", "StallReport"]

_SLOW = re.compile(r"Executing (?P<what>.+) took (?P<secs>[0-9.]+) seconds")


def _deprecated_field(old: str, new: str) -> property:
    """``old``, the rc1 name of the field ``new``: reads and writes it, and warns."""

    def get(self: StallReport) -> Any:
        renamed(f"StallReport.{old}", f"StallReport.{new}")
        return getattr(self, new)

    def put(self: StallReport, value: Any) -> None:
        renamed(f"StallReport.{old}", f"StallReport.{new}")
        setattr(self, new, value)

    get.__doc__ = f"Deprecated: use :attr:`{new}`."
    get.__deprecated__ = f"use {new}"  # type: ignore[attr-defined]
    return property(get, put)


@dataclass
class StallReport:
    """What a :class:`LoopStallMonitor` saw.  Durations in seconds.

    Example::

        report = monitor.report
        print(report.summary())          # "812 ticks in 1.02 s, stalled 3.1%, lateness p50 0.08 ms, ..."
        assert report.over(0.010) == 0   # no tick more than 10 ms late
    """

    ticks: int = 0
    elapsed_s: float = 0.0
    """Seconds the monitor ran."""
    lateness_s: list[float] = field(default_factory=list)
    """Seconds each tick was late, in tick order."""
    slow_callbacks: list[tuple[float, str]] = field(default_factory=list)
    """``(seconds, callback)`` of callbacks over the threshold (``capture_slow_callbacks=True`` only)."""
    noise_s: float = 0.001
    """Lateness up to this is the timer's own overshoot (waking a sleeping loop takes a fraction of a
    millisecond, more on a busy machine), not a stall: :attr:`stalled_fraction` leaves it out."""

    elapsed = _deprecated_field("elapsed", "elapsed_s")
    lateness = _deprecated_field("lateness", "lateness_s")
    noise = _deprecated_field("noise", "noise_s")

    @property
    def max_stall_s(self) -> float:
        """The longest time a tick was late: the loop's longest stall (under-estimated by at most one interval)."""
        return max(self.lateness_s, default=0.0)

    max_stall = deprecated_property("max_stall", "max_stall_s", lambda self: self.max_stall_s)

    @property
    def stalled_fraction(self) -> float:
        """Share of the monitored time the loop was stalled: the lateness of the ticks later than
        :attr:`noise_s`, summed, over :attr:`elapsed_s`."""
        if self.elapsed_s <= 0:
            return 0.0
        return sum(late for late in self.lateness_s if late > self.noise_s) / self.elapsed_s

    def over(self, seconds: float) -> int:
        """How many ticks were later than ``seconds``."""
        return sum(1 for late in self.lateness_s if late > seconds)

    def percentile_s(self, q: float) -> float:
        """The ``q`` quantile (0..1) of tick lateness, in seconds."""
        if not self.lateness_s:
            return 0.0
        ordered = sorted(self.lateness_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @deprecated_alias("percentile", "percentile_s")
    def percentile(self, q: float) -> float:
        """The ``q`` quantile (0..1) of tick lateness, in seconds."""
        return self.percentile_s(q)

    def summary(self) -> str:
        """One line: ticks, p50/p99/max lateness in milliseconds, slow callbacks."""
        return (
            f"{self.ticks} ticks in {self.elapsed_s:.2f} s, stalled {self.stalled_fraction:.1%}, "
            f"lateness p50 {self.percentile_s(0.5) * 1e3:.2f} ms, "
            f"p99 {self.percentile_s(0.99) * 1e3:.2f} ms, max {self.max_stall_s * 1e3:.2f} ms"
            + (f", slowest callback {max(self.slow_callbacks)}" if self.slow_callbacks else "")
        )


class LoopStallMonitor:
    """Measure the running loop's stalls with a ticker task: each tick's lateness is time the loop could not run.

    A ticker sleeps ``interval_s`` seconds again and again and records how late
    it woke up.  Anything that holds the loop's thread (a blocking call in a
    coroutine or callback, or the GIL held by another thread) shows up as
    lateness, whatever caused it.  With ``capture_slow_callbacks=True`` the
    loop also runs in debug mode with ``slow_callback_duration`` set to
    ``threshold_s`` and the callbacks asyncio reports as slow are collected, to
    name the culprit (debug mode itself slows the loop down).  ``interval``
    and ``threshold`` are the deprecated 0.1 names of ``interval_s`` and
    ``threshold_s``.

    Example::

        async with LoopStallMonitor() as monitor:
            await producer.commit_transaction()
        assert monitor.report.max_stall_s < 0.010, monitor.report.summary()
    """

    def __init__(
        self,
        interval_s: float = 0.001,
        *,
        capture_slow_callbacks: bool = False,
        threshold_s: float = 0.010,
        interval: float | None = None,
        threshold: float | None = None,
    ) -> None:
        interval_s = renamed_argument("LoopStallMonitor", "interval", interval, "interval_s", interval_s)
        threshold_s = renamed_argument("LoopStallMonitor", "threshold", threshold, "threshold_s", threshold_s)
        self.interval_s = interval_s
        """Seconds the ticker sleeps between ticks."""
        self.report = StallReport()
        self._capture = capture_slow_callbacks
        self._threshold = threshold_s
        self._task: asyncio.Task[None] | None = None
        self._handler: _SlowCallbackHandler | None = None
        self._restore: tuple[bool, float] | None = None
        self._started = 0.0

    async def __aenter__(self) -> LoopStallMonitor:
        loop = asyncio.get_running_loop()
        if self._capture:
            self._restore = (loop.get_debug(), loop.slow_callback_duration)
            loop.set_debug(True)
            loop.slow_callback_duration = self._threshold
            self._handler = _SlowCallbackHandler(self.report)
            logging.getLogger("asyncio").addHandler(self._handler)
        self._task = loop.create_task(self._tick(loop))
        await asyncio.sleep(0)  # let the ticker start before the measured code runs
        self._started = loop.time()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self.report.elapsed_s = asyncio.get_running_loop().time() - self._started
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        if self._handler is not None:
            logging.getLogger("asyncio").removeHandler(self._handler)
        if self._restore is not None:
            loop = asyncio.get_running_loop()
            loop.set_debug(self._restore[0])
            loop.slow_callback_duration = self._restore[1]

    async def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.report.lateness_s.append(max(0.0, loop.time() - due))
            self.report.ticks += 1


class _SlowCallbackHandler(logging.Handler):
    def __init__(self, report: StallReport) -> None:
        super().__init__(logging.WARNING)
        self._report = report

    def emit(self, record: logging.LogRecord) -> None:
        match = _SLOW.search(record.getMessage())
        if match:
            self._report.slow_callbacks.append((float(match["secs"]), match["what"][:200]))
