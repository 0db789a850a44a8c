"""How the test suite starts Python children that import the harness (zygotes, pool workers, scripts)."""

from __future__ import annotations

import os
from pathlib import Path

#: ``tests/``: on a child's ``sys.path`` so that it imports ``harness`` as the tests do.
TESTS = Path(__file__).resolve().parents[1]
#: The checkout, for children that import ``examples`` or run from its root.
REPO = TESTS.parent


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment, with ``tests/`` and the checkout first on ``PYTHONPATH``."""
    path = os.pathsep.join(p for p in (str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def cpu_wait_s(pid: int) -> float | None:
    """Seconds process ``pid`` spent runnable but waiting for a CPU (Linux ``schedstat``); ``None`` once it is gone.

    The Python threads of a process share the GIL, so their waits add up: their sum.  librdkafka's
    threads (``rdk:*``) run in parallel, and a call waits for one of them at a time: the longest.
    """
    python, rdk = 0, 0
    try:
        tasks = list(os.scandir(f"/proc/{pid}/task"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    for task in tasks:
        try:
            with open(f"{task.path}/comm") as f:
                comm = f.read().strip()
            with open(f"{task.path}/schedstat") as f:  # "<on cpu ns> <run-queue wait ns> <timeslices>"
                waited = int(f.read().split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
        if comm.startswith("rdk:"):
            rdk = max(rdk, waited)
        else:
            python += waited
    return (python + rdk) / 1e9


class CpuWaitLog:
    """Samples :func:`cpu_wait_s` of a changing set of processes, for wall-clock bounds on a shared machine.

    A bound on how long the processes took to do something is checked against the wall clock minus
    :meth:`waited_s` over the same window: the time the scheduler kept them from running is not theirs.
    """

    def __init__(self) -> None:
        self._samples: list[tuple[float, dict[int, float]]] = []

    def sample(self, pids: list[int], now: float) -> None:
        """Record the CPU wait of each process in ``pids`` at monotonic time ``now``."""
        self._samples.append((now, {pid: w for pid in pids if (w := cpu_wait_s(pid)) is not None}))

    def waited_s(self, since: float, until: float) -> float:
        """The most any one process waited for a CPU between ``since`` and ``until`` (the nearest samples outside).

        A process sampled at only one end counts from its first or up to its last sample in the window.
        """
        if not self._samples:
            return 0.0
        before = [s for t, s in self._samples if t <= since] or [self._samples[0][1]]
        after = [s for t, s in self._samples if t >= until] or [self._samples[-1][1]]
        inside = [s for t, s in self._samples if since <= t <= until]
        start, end = dict(before[-1]), dict(after[0])
        for snapshot in inside:  # processes that started or ended inside the window
            for pid, waited in snapshot.items():
                start.setdefault(pid, waited)
        for snapshot in reversed(inside):
            for pid, waited in snapshot.items():
                end.setdefault(pid, waited)
        return max((end[pid] - start[pid] for pid in start.keys() & end.keys()), default=0.0)
