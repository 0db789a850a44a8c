"""The dual-write recipe while its Kafka broker restarts (own broker on port_base() + 400, stopped afterwards).

The broker is stopped from the ``on_step`` hook right before the prepare
(flush) or right after the database commit, and started again from another
thread while the recipe waits.  Whatever the recipe then does (wait and
succeed, fail and roll back, or leave the transaction in doubt for the next
recovery), the database and the ``read_committed`` view of the topic must
agree and nothing may hang.  With ``kafka_timeout_s`` the transaction's exit
ends within that bound plus :data:`BOUND_SLACK_S`, also when the broker goes
down after the database commit.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from harness.dw_crash import check_consistency, items_table
from kafka2pc.recipes.dual_write import DualWriter, Step, WriterState, define_state_table

from kafka2pc import IndefiniteOutcomeError, Kafka2pcError, PreparedTxnState, TransactionOutcome
from kafka2pc.testing import create_topic
from kafka2pc.testing.broker import BrokerError, LocalKafka, port_base

BOUND_SLACK_S = 2.0
"""What a transaction's exit may overrun ``kafka_timeout_s`` by (docs/dual-write.md): the producer's
``TIMEOUT_SLACK_S`` (1 s) plus the database round trips of the failure path."""


@pytest.fixture(scope="module")
def own_kafka() -> Iterator[LocalKafka]:
    """A broker of our own, so that stopping it disturbs no other test.

    Its ports lie in Linux's ephemeral range, where a client connection can
    hold one for a while ("Address already in use"): fall back to the next
    base port rather than fail.
    """
    errors = []
    for base_port in (port_base() + 400, port_base() + 420, port_base() + 440):
        kafka = LocalKafka(base_port=base_port)
        try:
            kafka.start()
        except BrokerError as exc:
            errors.append(f"port {base_port}: {exc}\n{_log_tail(kafka)}")
            kafka.wipe()
            time.sleep(1.0)
            continue
        yield kafka
        kafka.wipe()
        return
    pytest.fail("could not start a broker of our own:\n" + "\n".join(errors), pytrace=False)


def _log_tail(kafka: LocalKafka) -> str:
    """The broker's last words, kept for the failure message before its directory is wiped."""
    lines: list[str] = []
    for path in (kafka.log_file(), kafka.home / "node1" / "stdout.log"):
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        lines += [line for line in text if "ERROR" in line or "Exception" in line][:5] or text[-5:]
    return "\n".join(lines)


CASES = [
    # (step at which the broker stops, kafka_timeout_s, database)
    pytest.param(Step.BODY_DONE, None, "sqlite", id="during-prepare-waits-sqlite"),
    pytest.param(Step.DB_COMMITTED, None, "sqlite", id="during-commit-waits-sqlite"),
    pytest.param(Step.BODY_DONE, 1.0, "postgresql", id="during-prepare-times-out-postgresql"),
    pytest.param(Step.DB_COMMITTED, 1.0, "postgresql", id="during-commit-times-out-postgresql"),
    pytest.param(Step.BODY_DONE, 1.0, "sqlite", id="during-prepare-times-out-sqlite"),
    pytest.param(Step.DB_COMMITTED, 1.0, "sqlite", id="during-commit-times-out-sqlite"),
]


@pytest.mark.parametrize(("stop_at", "kafka_timeout_s", "db_kind"), CASES)
def test_broker_restart_during_prepare_or_commit_keeps_both_sides_equal(
    own_kafka: LocalKafka, request: pytest.FixtureRequest, stop_at: Step, kafka_timeout_s: float | None,
    db_kind: str,
) -> None:
    """Without a timeout librdkafka waits the restart out; with ``kafka_timeout_s=1`` a prepare that
    times out rolls back, and a commit that times out is left in doubt within the bound: the next
    transaction recovers first and commits it."""
    db_url = str(request.getfixturevalue("pg_url" if db_kind == "postgresql" else "sqlite_url"))
    bootstrap = own_kafka.bootstrap_servers
    topic = create_topic(bootstrap, partitions=2)
    series = uuid.uuid4().hex[:10]
    engine = sa.create_engine(db_url)
    metadata = sa.MetaData()
    items = items_table(metadata)
    define_state_table(metadata)
    metadata.create_all(engine)
    restarted = threading.Event()
    restarter: list[threading.Thread] = []
    armed = False
    stopped_at: list[float] = []

    def restart_broker(step: Step) -> None:
        if step is stop_at and not restarter:
            own_kafka.stop_node(1)
            stopped_at.append(time.monotonic())

            def start_again() -> None:
                time.sleep(1.0)
                own_kafka.start_node(1)
                restarted.set()

            restarter.append(threading.Thread(target=start_again))
            restarter[0].start()

    writer = DualWriter(
        engine,
        # Reconnect quickly once the broker is back (librdkafka backs off up to 10 s by default).
        {"bootstrap.servers": bootstrap, "transactional.id": f"dw-restart-{series}", "reconnect.backoff.max.ms": 500,
         # Bounds librdkafka's own wait in the "waits" cases (kafka2pc raises the transaction timeout
         # to the broker's maximum, an hour here): once in 30 CI runs a record produced just before
         # the restart was never acknowledged afterwards, and the prepare waited for it indefinitely.
         "transaction.timeout.ms": 60_000},
        state_table=define_state_table(sa.MetaData()),
        kafka_timeout_s=kafka_timeout_s,
        on_step=lambda step: restart_broker(step) if armed else None,
    )
    writer.recover()

    def one(rid: str) -> None:
        with engine.connect() as conn, writer.transaction(conn) as tx:
            for i in range(4):
                full = f"{series}:{rid}-{i}"
                conn.execute(items.insert().values(id=full, series=series))
                tx.produce(topic, value=full.encode(), key=full.encode())

    one("before")
    armed = True
    outcome = "committed"
    started = time.monotonic()
    try:
        one("across-restart")
    except Kafka2pcError as exc:  # allowed before the database commit: both sides rolled back
        outcome = f"rolled back ({type(exc).__name__})"
        if stop_at is Step.DB_COMMITTED:
            # Only within a bound: the commit is left in doubt, never lost (checked below).
            assert kafka_timeout_s is not None, f"without a timeout the recipe must settle, not fail: {exc!r}"
            assert isinstance(exc, IndefiniteOutcomeError) and "not lost" in str(exc), repr(exc)
            assert time.monotonic() - stopped_at[0] <= kafka_timeout_s + BOUND_SLACK_S
            outcome = "left in doubt (IndefiniteOutcomeError)"
        else:
            assert stop_at is Step.BODY_DONE, f"only before the database commit may both sides roll back: {exc!r}"
    took = time.monotonic() - started
    if kafka_timeout_s is not None:
        # Committed or not, the call ends within its bound once the broker is gone (docs/deploying.md):
        # the commit and its settlement within kafka_timeout_s; the prepare, then the abort, within one each.
        bound_s = kafka_timeout_s * (1 if stop_at is Step.DB_COMMITTED else 2)
        assert time.monotonic() - stopped_at[0] <= bound_s + BOUND_SLACK_S, (outcome, took)
    armed = False
    assert restarted.wait(120)
    restarter[0].join(10)
    # The next transaction recovers first.  With kafka_timeout_s that recovery is bounded too: while the
    # restarted broker is still loading its coordinator it fails (typed, nothing written), and a later
    # call succeeds; the writer heals by itself, without a recover() call.
    healing = time.monotonic()
    while True:
        try:
            one("after")
            break
        except Kafka2pcError as exc:
            assert kafka_timeout_s is not None, f"without a timeout the recovery waits the restart out: {exc!r}"
            assert time.monotonic() - healing < 120, f"the writer did not heal within 120 s: {exc!r}"
    print(f"\nbroker restart at {stop_at.value} (kafka_timeout_s={kafka_timeout_s}) on {engine.dialect.name}: "
          f"transaction {outcome} in {took:.1f}s; recoveries: {writer.metrics().recoveries}")
    rows, records, problems = check_consistency(engine, bootstrap, topic, series)
    assert not problems, problems
    assert rows == records and rows in (8, 12)
    if stop_at is Step.DB_COMMITTED:
        assert rows == 12  # the database committed: Kafka must have, too
    writer.close()
    engine.dispose()


@pytest.mark.parametrize("db_kind", ["sqlite", "postgresql"])
def test_broker_down_after_the_database_commit_ends_within_kafka_timeout(
    own_kafka: LocalKafka, request: pytest.FixtureRequest, db_kind: str
) -> None:
    """``kafka_timeout_s`` bounds the whole exit of ``with writer.transaction(...)`` when the broker dies
    after the database commit: the transaction stays in doubt (committed in the database, prepared in
    Kafka), the error says so, and ``recover()`` commits it once the broker is back."""
    kafka_timeout_s = 3.0
    db_url = str(request.getfixturevalue("pg_url" if db_kind == "postgresql" else "sqlite_url"))
    bootstrap = own_kafka.bootstrap_servers
    topic = create_topic(bootstrap, partitions=2)
    series = uuid.uuid4().hex[:10]
    engine = sa.create_engine(db_url)
    metadata = sa.MetaData()
    items = items_table(metadata)
    states = define_state_table(metadata)
    metadata.create_all(engine)
    stopped_at: list[float] = []
    armed = False

    def stop_broker(step: Step) -> None:
        if armed and step is Step.DB_COMMITTED and not stopped_at:
            own_kafka.stop_node(1, kill=True)
            stopped_at.append(time.monotonic())

    tid = f"dw-bound-{series}"
    writer = DualWriter(
        engine, {"bootstrap.servers": bootstrap, "transactional.id": tid, "reconnect.backoff.max.ms": 500},
        state_table=define_state_table(sa.MetaData()), kafka_timeout_s=kafka_timeout_s, on_step=stop_broker,
    )
    writer.recover()

    def one(rid: str) -> None:
        with engine.connect() as conn, writer.transaction(conn) as tx:
            for i in range(4):
                full = f"{series}:{rid}-{i}"
                conn.execute(items.insert().values(id=full, series=series))
                tx.produce(topic, value=full.encode(), key=full.encode())

    one("before")
    armed = True
    try:
        with pytest.raises(IndefiniteOutcomeError) as info:
            one("broker-down")
        took = time.monotonic() - stopped_at[0]
    finally:
        armed = False
        own_kafka.start_node(1)
    print(f"\nbroker killed after the database commit ({engine.dialect.name}, kafka_timeout_s={kafka_timeout_s:g}): "
          f"IndefiniteOutcomeError after {took:.2f} s: {info.value}")
    assert took <= kafka_timeout_s + BOUND_SLACK_S, f"took {took:.2f} s for kafka_timeout_s={kafka_timeout_s}"
    message = str(info.value)
    assert "not lost" in message and "recover()" in message and "do not redo" in message, message
    in_doubt = info.value.state
    assert isinstance(in_doubt, PreparedTxnState) and not in_doubt.is_empty
    assert writer.state is WriterState.NEEDS_RECOVERY
    assert writer.metrics().in_doubt_transactions == 1
    with engine.connect() as conn:  # the database committed it: its state is the one stored
        stored = conn.execute(sa.select(states.c.prepared_txn_state).where(states.c.transactional_id == tid))
        assert stored.scalar_one() == str(in_doubt)
    result = writer.recover()
    assert result.settlement is not None and result.settlement.outcome is TransactionOutcome.COMMITTED, result
    assert writer.metrics().in_doubt_transactions == 0
    rows, records, problems = check_consistency(engine, bootstrap, topic, series)
    assert not problems, problems
    assert rows == records == 8
    writer.close()
    engine.dispose()
