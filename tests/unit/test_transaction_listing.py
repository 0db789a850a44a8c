"""``TransactionAdmin.list_transactions``: oldest first, every age against one clock reading (pure logic).

The descriptions arrive one request after another; on a loaded cluster they are seconds apart.  An age taken
as each arrived would rank a younger transaction described later above an older one described first.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kafka2pc import TransactionAdmin
from kafka2pc._types import TransactionDescription


class _SlowCoordinator:
    """A control plane whose descriptions take ``delay_s`` each (no partitions, so no offsets are asked for)."""

    def __init__(self, starts: dict[str, int], delay_s: float) -> None:
        self.starts, self.delay_s = starts, delay_s

    @contextmanager
    def deadline(self, timeout_s: float | None) -> Iterator[None]:
        yield

    def list_transactions(self, *, states: Any = ()) -> list[SimpleNamespace]:
        return [SimpleNamespace(transactional_id=tid) for tid in self.starts]

    def describe_transaction(self, tid: str) -> TransactionDescription | None:
        time.sleep(self.delay_s)
        start = self.starts[tid]
        state = "Ongoing" if start > 0 else "CompleteCommit"
        return TransactionDescription(tid, state, 1, 0, 60_000, start, (), 1)


def _listed(starts: dict[str, int], **kwargs: Any) -> list[tuple[str, float | None]]:
    admin = TransactionAdmin({"bootstrap.servers": "127.0.0.1:1"}, control_plane=cast(Any, _SlowCoordinator(starts, 0.05)))
    return [(i.transactional_id, i.open_for_s) for i in admin.list_transactions(**kwargs)]


def test_oldest_first_though_described_first_and_younger_by_less_than_the_description_delay() -> None:
    now = int(time.time() * 1000)
    listed = _listed({"older": now - 10_000, "younger-by-5ms": now - 9_995, "done": -1})
    assert [tid for tid, _ in listed] == ["older", "younger-by-5ms", "done"]
    (_, older), (_, younger), (_, done) = listed
    assert older is not None and younger is not None
    assert older - younger == pytest.approx(0.005) and done is None  # one clock reading for every age


def test_min_open_s_keeps_open_transactions_at_least_that_old() -> None:
    now = int(time.time() * 1000)
    listed = _listed({"old": now - 60_000, "new": now - 1_000, "done": -1}, min_open_s=30)
    assert [tid for tid, _ in listed] == ["old"]
