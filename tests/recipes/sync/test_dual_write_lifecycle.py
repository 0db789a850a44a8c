"""The writer's life cycle table, one assertion per cell (pure logic, no services)."""

from __future__ import annotations

import pytest
from kafka2pc.recipes.dual_write import WriterState
from kafka2pc.recipes.dual_write._lifecycle import TRANSITIONS, check_transition

from kafka2pc import IllegalStateError

S = WriterState
#: The allowed changes, written out independently of the implementation's table.
ALLOWED = {
    (S.NEW, S.RECOVERING), (S.NEW, S.CLOSED),
    (S.RECOVERING, S.READY), (S.RECOVERING, S.NEEDS_RECOVERY), (S.RECOVERING, S.FENCED),
    (S.READY, S.IN_TRANSACTION), (S.READY, S.RECOVERING), (S.READY, S.CLOSED),
    (S.IN_TRANSACTION, S.READY), (S.IN_TRANSACTION, S.NEEDS_RECOVERY), (S.IN_TRANSACTION, S.FENCED),
    (S.IN_TRANSACTION, S.RECOVERING), (S.IN_TRANSACTION, S.CLOSED),
    (S.NEEDS_RECOVERY, S.RECOVERING), (S.NEEDS_RECOVERY, S.FENCED), (S.NEEDS_RECOVERY, S.CLOSED),
    (S.FENCED, S.RECOVERING), (S.FENCED, S.CLOSED),
    (S.CLOSED, S.RECOVERING), (S.CLOSED, S.CLOSED),
}


@pytest.mark.parametrize("current", list(WriterState))
@pytest.mark.parametrize("target", list(WriterState))
def test_every_cell_of_the_transition_table(current: WriterState, target: WriterState) -> None:
    if (current, target) in ALLOWED:
        check_transition("tid", current, target)
        assert target in TRANSITIONS[current]
    else:
        with pytest.raises(IllegalStateError, match=f"'tid': writer state {current.value} cannot become"):
            check_transition("tid", current, target)


def test_a_fenced_writer_only_recovers_or_closes() -> None:
    assert TRANSITIONS[S.FENCED] == {S.RECOVERING, S.CLOSED}
