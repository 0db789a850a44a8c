"""One test per cell of the state machine's tables (no broker).

The specification is written out here, independently of
:mod:`kafka2pc._machine`: ``ALLOWED_TRANSITIONS`` (source -> target pairs) and
``ALLOWED_OPERATIONS`` (operation -> states) follow KIP-939 and the Java
client's ``TransactionManager``.  Each cell checks that the gate does what the
specification says, so a change to either table of the library shows up as a
named failing case.
"""

from __future__ import annotations

import itertools
import threading

import pytest

from kafka2pc import IllegalStateError, TxnState
from kafka2pc._machine import OPERATIONS, TRANSITIONS, StateMachine

ALL_STATES = list(TxnState)
TERMINAL = {TxnState.FATAL_ERROR, TxnState.CLOSED}

_U, _R, _T, _P = TxnState.UNINITIALIZED, TxnState.READY, TxnState.IN_TRANSACTION, TxnState.PREPARED
_V, _D, _A, _F, _C = (TxnState.RECOVERING, TxnState.IN_DOUBT, TxnState.ABORTABLE_ERROR, TxnState.FATAL_ERROR,
                      TxnState.CLOSED)

#: (source, target) pairs the gate must allow; every other pair it must refuse.
ALLOWED_TRANSITIONS: frozenset[tuple[TxnState, TxnState]] = frozenset({
    (_U, _R),  # init_transactions without a prepared transaction to keep
    (_U, _V),  # init_transactions that found a prepared transaction: only commit/abort/complete follow
    (_R, _T),  # begin_transaction
    (_T, _P),  # prepare_transaction (KIP-939: flush, then only commit/abort/complete)
    (_T, _R), (_P, _R), (_V, _R), (_D, _R), (_A, _R),  # a commit or abort finished
    # An indefinite outcome (a timed-out EndTxn) from any call that ends a transaction; retried in place.
    (_T, _D), (_P, _D), (_V, _D), (_D, _D), (_A, _D),
    (_T, _A), (_P, _A), (_A, _A),  # an abortable error while a transaction is open
    # Any live state may turn fatal; fatal is terminal (only close follows).
    *((source, _F) for source in (_U, _R, _T, _P, _V, _D, _A)),
    *((source, _C) for source in TxnState),  # close() from anywhere, closed again included
})

#: Operation -> the states it may be called in.
ALLOWED_OPERATIONS: dict[str, frozenset[TxnState]] = {
    "init_transactions": frozenset({_U}),
    "begin_transaction": frozenset({_R}),
    "produce": frozenset({_T}),
    "send_offsets_to_transaction": frozenset({_T}),
    "prepare_transaction": frozenset({_T}),
    "commit_transaction": frozenset({_T, _P, _V, _D}),
    "abort_transaction": frozenset({_T, _P, _V, _D, _A}),  # abort is the way out of an abortable error
    "complete_transaction": frozenset({_P, _V, _D}),  # KIP-939: only for a prepared (or recovered) transaction
}


def machine_in(state: TxnState, *, in_doubt_operation: str | None = None) -> StateMachine:
    """A gate placed directly in ``state`` (white-box: tables are tested cell by cell)."""
    machine = StateMachine()
    machine._state = state
    if state is TxnState.IN_DOUBT:
        machine._in_doubt_operation = in_doubt_operation or "commit_transaction"
    return machine


def test_tables_cover_every_state_and_operation() -> None:
    assert set(TRANSITIONS) == set(TxnState)
    assert set(OPERATIONS) == set(ALLOWED_OPERATIONS) == {
        "init_transactions",
        "begin_transaction",
        "produce",
        "send_offsets_to_transaction",
        "prepare_transaction",
        "commit_transaction",
        "abort_transaction",
        "complete_transaction",
    }
    for states in itertools.chain(TRANSITIONS.values(), OPERATIONS.values()):
        assert states <= set(TxnState)


@pytest.mark.parametrize(
    ("target", "source"),
    list(itertools.product(ALL_STATES, ALL_STATES)),
    ids=lambda s: s.value,
)
def test_transition_cell(target: TxnState, source: TxnState) -> None:
    machine = machine_in(source)
    cause = RuntimeError("cause")
    if (source, target) in ALLOWED_TRANSITIONS:
        machine.transition_to(target, cause=cause, operation="commit_transaction")
        assert machine.state is target
        if target in (TxnState.ABORTABLE_ERROR, TxnState.FATAL_ERROR, TxnState.IN_DOUBT):
            assert machine.cause is cause
        elif target is not TxnState.CLOSED:
            assert machine.cause is None
        expected_op = "commit_transaction" if target is TxnState.IN_DOUBT else None
        assert machine.in_doubt_operation == expected_op
    else:
        with pytest.raises(IllegalStateError, match=f"{source.value} -> {target.value}"):
            machine.transition_to(target, cause=cause)
        assert machine.state is source  # a refused transition changes nothing


@pytest.mark.parametrize(
    ("operation", "state"),
    list(itertools.product(sorted(ALLOWED_OPERATIONS), ALL_STATES)),
    ids=lambda x: x if isinstance(x, str) else x.value,
)
def test_operation_cell(operation: str, state: TxnState) -> None:
    # In IN_DOUBT the gate also requires the same operation (or complete): use it here,
    # the refusal of the others is tested separately below.
    machine = machine_in(state, in_doubt_operation=operation if operation != "complete_transaction" else None)
    if state in ALLOWED_OPERATIONS[operation]:
        assert machine.check(operation) is state
    else:
        with pytest.raises(IllegalStateError, match=f"{operation}\\(\\) is not allowed in state {state.value}"):
            machine.check(operation)
    assert machine.state is state  # check() never moves the machine


@pytest.mark.parametrize("in_doubt", ["commit_transaction", "abort_transaction", "complete_transaction"])
@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_in_doubt_allows_only_the_same_call_or_complete(in_doubt: str, operation: str) -> None:
    """KAFKA-17754: after an indefinite outcome nothing new may start before it is settled."""
    machine = machine_in(TxnState.IN_DOUBT, in_doubt_operation=in_doubt)
    if operation in (in_doubt, "complete_transaction"):
        assert machine.check(operation) is TxnState.IN_DOUBT
    else:
        with pytest.raises(IllegalStateError, match="outcome|not allowed"):
            machine.check(operation)


def test_terminal_states_have_no_way_out() -> None:
    for state in TERMINAL:
        reachable = TRANSITIONS[state]
        assert reachable <= {TxnState.CLOSED}
        assert not any(state in allowed for allowed in OPERATIONS.values())


def test_every_state_except_closed_and_uninitialized_is_reachable_from_uninitialized() -> None:
    seen = {TxnState.UNINITIALIZED}
    frontier = [TxnState.UNINITIALIZED]
    while frontier:
        source = frontier.pop()
        for target in TRANSITIONS[source]:
            if target not in seen:
                seen.add(target)
                frontier.append(target)
    assert seen == set(TxnState)


def test_prepared_allows_only_commit_abort_complete() -> None:
    """KIP-939: after prepareTransaction only commit, abort and completeTransaction."""
    allowed = {op for op, states in OPERATIONS.items() if TxnState.PREPARED in states}
    assert allowed == {"commit_transaction", "abort_transaction", "complete_transaction"}
    recovering = {op for op, states in OPERATIONS.items() if TxnState.RECOVERING in states}
    assert recovering == allowed


def test_refusal_messages_say_what_to_do() -> None:
    cause = RuntimeError("boom")
    machine = machine_in(TxnState.FATAL_ERROR)
    machine._cause = cause
    with pytest.raises(IllegalStateError, match="fatal error .*boom.*create a new one"):
        machine.check("begin_transaction")
    with pytest.raises(IllegalStateError, match="call init_transactions\\(\\) first"):
        StateMachine().check("begin_transaction")
    with pytest.raises(IllegalStateError, match="only commit, abort or complete"):
        machine_in(TxnState.PREPARED).check("produce")


def test_error_cause_is_kept_and_cleared() -> None:
    machine = StateMachine()
    machine.transition_to(TxnState.READY)
    machine.transition_to(TxnState.IN_TRANSACTION)
    cause = RuntimeError("delivery failed")
    machine.transition_to(TxnState.ABORTABLE_ERROR, cause=cause)
    assert machine.cause is cause
    machine.transition_to(TxnState.READY)
    assert machine.cause is None
    machine.transition_to(TxnState.FATAL_ERROR, cause=cause)
    machine.transition_to(TxnState.CLOSED)
    assert machine.cause is cause  # closing keeps the reason the producer died


def test_gate_is_atomic_under_threads() -> None:
    """Two threads racing READY -> IN_TRANSACTION: exactly one wins, every time."""
    for _ in range(200):
        machine = machine_in(TxnState.READY)
        barrier = threading.Barrier(2)
        results: list[bool] = []

        def race(m: StateMachine = machine, b: threading.Barrier = barrier) -> None:
            b.wait()
            try:
                m.transition_to(TxnState.IN_TRANSACTION)
                results.append(True)
            except IllegalStateError:
                results.append(False)

        threads = [threading.Thread(target=race) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
        assert sorted(results) == [False, True]
        assert machine.state is TxnState.IN_TRANSACTION
