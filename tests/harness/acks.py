"""The acknowledged-write log: what a crash child told its caller was done, checked after its ``kill -9``.

A transaction whose ``with`` block (or ``async with``, or pool call, or HTTP request) returned normally
was acknowledged to the application. Whatever is killed afterwards, it must be in the database and
exactly once among the ``read_committed`` records. A check that compares only ``rows == records``
passes when an acknowledged transaction is lost on both sides; this one does not.

The contract between a child and its test:

- the test gives the child a path (``AckLog(path)``; children get it as ``$KAFKA2PC_ACK_LOG`` or an
  argument);
- the child calls :meth:`AckLog.record` with the transaction's id *after* the block returned and before
  it does anything else; the line is appended and ``fsync``ed, so it survives the child's ``kill -9``
  (a kill during ``record`` loses at most that one line: the write was not acknowledged yet);
- the test calls :func:`check_acknowledged` with the ids it found in the database and in a
  ``read_committed`` consumer.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

#: The environment variable through which a test hands a child its log's path.
ACK_LOG_ENV = "KAFKA2PC_ACK_LOG"


class AckLog:
    """An append-only, fsynced file of acknowledged ids, one per line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def from_env(cls) -> AckLog | None:
        """The log a test handed this child through ``$KAFKA2PC_ACK_LOG``, or None."""
        raw = os.environ.get(ACK_LOG_ENV)
        return cls(raw) if raw else None

    def record(self, ack_id: object) -> None:
        """Append ``ack_id`` and fsync: once this returns, the acknowledgement survives ``kill -9``."""
        text = str(ack_id)
        if not text or "\n" in text:
            raise ValueError(f"an acknowledged id is one non-empty line, not {text!r}")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (text + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def ids(self) -> list[str]:
        """Every acknowledged id, in order (a torn last line, from a kill inside ``record``, is dropped)."""
        if not self.path.exists():
            return []
        data = self.path.read_text()
        lines = data.split("\n")
        # The last element is "" after a complete line, or the torn remains of one the kill interrupted.
        return [line for line in lines[:-1] if line]


def check_acknowledged(
    log: AckLog | Iterable[str],
    db_ids: Iterable[object],
    kafka_ids: Iterable[object],
) -> list[str]:
    """The violations of "every acknowledged write is kept, once": an empty list when there are none.

    ``db_ids`` are the ids of the database's rows, ``kafka_ids`` those of the ``read_committed`` records
    (with repetitions: a duplicate record is a violation).
    """
    acked = log.ids() if isinstance(log, AckLog) else [str(i) for i in log]
    in_db = {str(i) for i in db_ids}
    in_kafka = Counter(str(i) for i in kafka_ids)
    failures: list[str] = []
    for dup, times in Counter(acked).items():
        if times > 1:
            failures.append(f"id {dup} was acknowledged {times} times (the test's ids are not unique)")
    for ack_id in dict.fromkeys(acked):
        if ack_id not in in_db:
            failures.append(f"acknowledged id {ack_id} is not in the database")
        if in_kafka[ack_id] != 1:
            failures.append(f"acknowledged id {ack_id} has {in_kafka[ack_id]} read_committed records, not 1")
    return failures


def assert_acknowledged(log: AckLog | Iterable[str], db_ids: Iterable[object], kafka_ids: Iterable[object]) -> int:
    """Assert :func:`check_acknowledged` finds nothing; return how many ids were acknowledged."""
    acked = log.ids() if isinstance(log, AckLog) else [str(i) for i in log]
    failures = check_acknowledged(acked, db_ids, kafka_ids)
    assert not failures, "acknowledged writes lost or duplicated:\n" + "\n".join(failures[:20])
    return len(acked)
