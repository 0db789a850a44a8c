"""Crash recovery with the asyncio API: an async dual-writing child is ``kill -9``-ed, the parent recovers.

The child (``_aio_child.py``) runs :class:`AsyncTwoPhaseCommitProducer` on an
event loop and writes SQLite rows with KIP-939's recipe.  After the kill the
parent recovers with the asyncio API, either way a restarted service would:
``init_transactions(keep_prepared_txn=True)`` + ``complete_transaction(state)``
on a new producer, or ``AsyncTransactionAdmin.complete_transaction``; then it
checks the real end state: every database row has exactly one
``read_committed`` record and vice versa, and nothing is left hanging.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable

import pytest
from harness.kafka_judge import assert_nothing_open
from harness.loop import run
from harness.scenario import Scenario

from kafka2pc import Decision, PreparedTxnState, TransactionOutcome, TxnState
from kafka2pc.aio import AsyncTransactionAdmin, AsyncTwoPhaseCommitProducer

ScenarioFactory = Callable[..., Scenario]


def values(txn: int, count: int) -> list[str]:
    return [f"{txn}-{i}" for i in range(count)]


async def recover_with_producer(s: Scenario, state: PreparedTxnState) -> tuple[Decision, TxnState]:
    """A restarted service's recovery: keep the prepared transaction, complete it with the stored state."""
    async with AsyncTwoPhaseCommitProducer(s.config) as producer:
        await producer.init_transactions(keep_prepared_txn=True)
        assert producer.state is TxnState.RECOVERING
        await producer.complete_transaction(state)
        settlement = producer.last_settlement
        assert settlement is not None
        # The recovered producer is an ordinary producer again.
        await producer.begin_transaction()
        await producer.abort_transaction()
        return settlement.plan.decision, producer.state


async def recover_with_admin(s: Scenario, state: PreparedTxnState) -> Decision:
    async with AsyncTransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
        settlement = await admin.complete_transaction(s.transactional_id, state)
        return settlement.plan.decision


@pytest.mark.parametrize("recovery", ["producer", "admin"])
@pytest.mark.parametrize(
    ("steps", "marker", "decision", "expected"),
    [
        (("commit:2", "stored:3"), "STORED", Decision.COMMIT, values(0, 2) + values(1, 3)),
        (("commit:2", "prepared:3"), "PREPARED", Decision.ABORT, values(0, 2)),
        (("commit:2", "open:3"), "OPEN", Decision.ABORT, values(0, 2)),
        (("commit:2",), "READY", Decision.NOTHING, values(0, 2)),
    ],
    ids=["stored", "prepared-not-stored", "open", "committed"],
)
def test_kill_at_each_step_then_recover(
    kafka_bootstrap: str,
    scenario_factory: ScenarioFactory,
    steps: tuple[str, ...],
    marker: str,
    decision: Decision,
    expected: list[str],
    recovery: str,
) -> None:
    s = scenario_factory(kafka_bootstrap, partitions=2)
    child = s.spawn(*steps)
    child.expect("INIT")
    child.expect("COMMITTED")
    if marker != "READY":
        child.expect(marker)
    child.kill()
    if decision is not Decision.NOTHING:
        s.assert_hanging()  # the killed instance left its transaction open
    state = s.stored_state()
    if recovery == "producer":
        decided, final = run(recover_with_producer(s, state))
        assert final is TxnState.READY
    else:
        decided = run(recover_with_admin(s, state))
    assert decided is decision
    s.assert_consistent(expected)
    assert s.acks.ids() == values(0, 2)  # the first transaction, acknowledged; the killed one not


ROUNDS = 12
"""Kills of the random test. A round's kill is one of :data:`KILLS`, in turn; a kill at a drawn moment lands
between the prepare and the database COMMIT (an abort) in only a few rounds of a hundred, so the aimed kinds
make both decisions certain and each one's decision exact. A round takes about 1.4 s."""

KILLS = ("moment", "prepared", "moment", "stored")
"""``moment``: after a drawn 0-0.6 s of a looping writer; ``prepared``: after a drawn number of full
transactions, at a prepared transaction not yet stored (recovery must abort it); ``stored``: at one the
database committed, before Kafka's commit (recovery must commit it)."""

AIMED = {"prepared": (Decision.ABORT, "PREPARED"), "stored": (Decision.COMMIT, "STORED")}


def _txns(values: list[str]) -> Counter[int]:
    """Records per transaction number (values are ``<txn>-<i>``)."""
    return Counter(int(v.split("-")[0]) for v in values)


def test_random_kills_of_a_looping_async_writer(
    kafka_bootstrap: str, scenario_factory: ScenarioFactory, seed: int
) -> None:
    """kill -9 at random moments of continuous transactions, and at aimed steps after a drawn number of them;
    after each recovery DB and Kafka agree.

    Exactly: the transactions visible after a round are the ones acknowledged (the child's fsynced log)
    plus at most the life's last one, which the database committed: visible iff recovery committed it, or
    its Kafka commit had returned when the kill came before the acknowledgement (decision "nothing").
    An aimed kill's decision is the one its step requires.
    """
    s = scenario_factory(kafka_bootstrap, partitions=3)
    rng = random.Random(seed)
    decisions: Counter[str] = Counter()
    unacked_kept = 0
    visible_txns: set[int] = set()
    for rounds in range(ROUNDS):
        kill = KILLS[rounds % len(KILLS)]
        acked_before = set(_txns(s.acks.ids()))
        if kill == "moment":
            child = s.spawn("loop:4:30")
            child.expect("INIT")
            child.expect("COMMITTED")  # at least one transaction per life
            time.sleep(rng.uniform(0.0, 0.6))  # when the kill comes (drawn), not a wait for anything
        else:
            full = rng.randint(1, 4)
            child = s.spawn(f"loop:4:30:{full}", f"{kill}:4")
            child.expect("INIT")
            for _ in range(full):
                child.expect("COMMITTED")
            child.expect(AIMED[kill][1])
        child.kill()
        state = s.stored_state()
        if rounds % 2:
            decided = run(recover_with_admin(s, state))
        else:
            decided, _ = run(recover_with_producer(s, state))
        decisions[decided.value] += 1
        if kill != "moment":
            assert decided is AIMED[kill][0], (rounds, kill, decided)
        visible = s.assert_consistent()  # rows == records, every acknowledged value kept once, nothing open
        per_txn = _txns(visible)
        assert set(per_txn.values()) == {4}, per_txn  # whole transactions only
        new = set(per_txn) - visible_txns
        unacked = new - (set(_txns(s.acks.ids())) - acked_before)
        last = max(_txns(s.db_values()))
        if decided is Decision.COMMIT:
            assert unacked == {last}, (decided, sorted(new), sorted(unacked), last)  # the one recovery committed
        elif decided is Decision.ABORT:
            assert unacked == set(), (decided, sorted(new), sorted(unacked))
        else:
            assert unacked <= {last}, (decided, sorted(new), sorted(unacked), last)
        unacked_kept += len(unacked)
        visible_txns = set(per_txn)
    acked = len(set(_txns(s.acks.ids())))
    print(f"\n{ROUNDS} kills, recovery decisions: {dict(decisions)}, {len(visible_txns)} transactions visible "
          f"({acked} acknowledged, {unacked_kept} kept by recovery or committed before their acknowledgement)")
    assert decisions["commit"] >= KILLS.count("stored") * ROUNDS // len(KILLS)
    assert decisions["abort"] >= KILLS.count("prepared") * ROUNDS // len(KILLS)
    assert sum(decisions.values()) == ROUNDS
    assert len(visible_txns) == acked + unacked_kept
    assert unacked_kept >= decisions["commit"]
    assert acked >= ROUNDS  # every life committed at least one transaction before its kill
    assert_nothing_open(kafka_bootstrap, [s.transactional_id], topics=[s.topic])  # Kafka's own tool agrees


def test_transaction_outcome_and_plan_through_the_async_admin(
    kafka_bootstrap: str, scenario_factory: ScenarioFactory
) -> None:
    s = scenario_factory(kafka_bootstrap)
    child = s.spawn("commit:1", "stored:2")
    child.expect("INIT")
    child.expect("COMMITTED")
    stored = PreparedTxnState(child.expect("STORED"))
    child.kill()

    async def go() -> None:
        async with AsyncTransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
            info = await admin.describe_transaction(s.transactional_id)
            assert info is not None and info.is_open and info.state == "Ongoing"
            assert [i.transactional_id for i in await admin.list_transactions(min_open_s=0)].count(
                s.transactional_id
            ) == 1
            assert await admin.transaction_outcome(s.transactional_id, stored) is TransactionOutcome.ONGOING
            plan = await admin.plan_recovery(s.transactional_id, stored)
            assert plan.decision is Decision.COMMIT
            settlement = await admin.complete_transaction(s.transactional_id, stored)
            assert settlement.outcome is TransactionOutcome.COMMITTED
            # Retry-safe: completing again with the same state reports the commit, sends nothing new.
            again = await admin.complete_transaction(s.transactional_id, stored)
            assert again.plan.decision is Decision.NOTHING
            assert await admin.transaction_outcome(s.transactional_id, stored) is TransactionOutcome.COMMITTED

    run(go())
    s.assert_consistent(values(0, 1) + values(1, 2))


def test_force_terminate_through_the_async_admin(kafka_bootstrap: str, scenario_factory: ScenarioFactory) -> None:
    s = scenario_factory(kafka_bootstrap)
    child = s.spawn("commit:1", "stored:2")
    child.expect("INIT")
    child.expect("COMMITTED")
    child.expect("STORED")
    child.kill()

    async def go() -> None:
        async with AsyncTransactionAdmin({"bootstrap.servers": s.bootstrap}) as admin:
            before = await admin.force_terminate_transaction(s.transactional_id)
            assert before is not None and before.state == "Ongoing"
            assert await admin.force_terminate_transaction("k2pc-aio-never-used") is None

    run(go())
    # The operator aborted the stored transaction: Kafka has only the first one (a real divergence,
    # which is why force-terminate is an operator's tool and recovery uses complete_transaction).
    assert s.visible() == values(0, 1)
    assert s.db_values() == values(0, 1) + values(1, 2)
