"""Pipelined commit: the Kafka commit of a transaction whose database COMMIT is durable, in the background.

Once the database committed the prepared state, the outcome is decided:
recovery would commit the Kafka transaction if this process died now.  So
the application need not wait for Kafka's EndTxn: :class:`CommitPipeline`
runs it in the background (a worker thread, or a task of the loop: the
pool's runtime decides), on the producer of the slot that prepared it,
while the application's next transaction runs on another slot.

Order per partition is kept: a later transaction of the same thread begins
after the earlier one's block returned, that is after the earlier one's
records were acknowledged (the prepare flushes them), so its records get
higher offsets; ``read_committed`` consumers receive records in offset order
and never past an open transaction (the last stable offset), whichever of
the two commits finishes first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._runtime import Event, Runtime

__all__ = ["CommitPipeline", "InFlightCommit"]

logger = logging.getLogger("kafka2pc.recipes.dual_write._pool")


class InFlightCommit:
    """One background Kafka commit: wait for it, and learn its error."""

    def __init__(self, transactional_id: str, done: Event | None = None) -> None:
        self.transactional_id = transactional_id
        self.started = time.monotonic()
        self.finished: float | None = None
        self.error: BaseException | None = None
        self._done: Event = done if done is not None else threading.Event()

    @property
    def done(self) -> bool:
        """True once the commit returned (or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the commit; raise its error, or :class:`TimeoutError` after ``timeout``."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.transactional_id!r}: the Kafka commit did not finish within {timeout} s")
        if self.error is not None:
            raise self.error


class CommitPipeline:
    """At most ``max_in_flight`` background commits; the next :meth:`submit` waits for a free place."""

    def __init__(self, runtime: Runtime, max_in_flight: int, slow_commit_s: float) -> None:
        self._runtime = runtime
        self._places = runtime.semaphore(max_in_flight)
        self._workers = runtime.workers(max_in_flight, "k2pc-commit")
        self._slow_s = slow_commit_s
        self._lock = threading.Lock()
        self._in_flight: list[InFlightCommit] = []
        self._unreported: list[BaseException] = []
        self.slow_commits = 0

    @property
    def in_flight(self) -> int:
        """Commits submitted and not finished."""
        return len(self._in_flight)

    def oldest_age_s(self) -> float | None:
        """Seconds since the oldest unfinished commit was submitted (``None``: none)."""
        with self._lock:
            oldest = min((c.started for c in self._in_flight), default=None)
        return None if oldest is None else time.monotonic() - oldest

    def submit(self, transactional_id: str, commit: Callable[[], None], on_done: Callable[[], None]) -> InFlightCommit:
        """Run ``commit`` in the background, then ``on_done`` (whatever happened)."""
        self._places.acquire()
        item = InFlightCommit(transactional_id, self._runtime.event())
        with self._lock:
            self._in_flight.append(item)
        try:
            self._workers.spawn(lambda: self._run(item, commit, on_done))
        except BaseException:
            self._finish(item)
            raise
        return item

    def _run(self, item: InFlightCommit, commit: Callable[[], None], on_done: Callable[[], None]) -> None:
        try:
            commit()
        except BaseException as exc:  # noqa: BLE001 - kept for wait() / wait_all(), logged here
            item.error = exc
            logger.error("%s: background Kafka commit failed: %s", item.transactional_id, exc)
        finally:
            elapsed = time.monotonic() - item.started
            if elapsed > self._slow_s:
                self.slow_commits += 1
                logger.warning("%s: slow Kafka commit: %.3f s (slow_commit_s=%g)",
                               item.transactional_id, elapsed, self._slow_s)
            try:
                on_done()
            finally:
                self._finish(item)

    def _finish(self, item: InFlightCommit) -> None:
        item.finished = time.monotonic()
        with self._lock:
            self._in_flight.remove(item)
            if item.error is not None:
                self._unreported.append(item.error)
        item._done.set()
        self._places.release()

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait for every commit submitted so far; raise the first error not reported yet."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending = list(self._in_flight)
        for item in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not item._done.wait(left):
                raise TimeoutError(f"{item.transactional_id!r}: the Kafka commit did not finish within {timeout} s")
        with self._lock:
            errors, self._unreported = self._unreported, []
        if errors:
            raise errors[0]

    def drain(self, timeout: float) -> None:
        """Wait (up to ``timeout``) for the commits in flight; errors are logged, not raised."""
        try:
            self.wait_all(timeout)
        except TimeoutError:
            logger.error("%d Kafka commits still in flight after %g s: their ids are left to recovery",
                         self.in_flight, timeout)
        except BaseException as exc:  # noqa: BLE001 - each was logged when it failed
            logger.debug("draining: a background commit had failed: %s", exc)

    def close(self) -> None:
        """Stop the workers (after :meth:`drain`)."""
        self._workers.close()
