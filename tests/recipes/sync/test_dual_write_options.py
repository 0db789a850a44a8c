"""WriterOptions (one checked value for writers, pools and the Django app) and the step listeners.

The option checks are pure logic; the listeners run one transaction on a writer and on a pool (real
broker, SQLite).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import sqlalchemy as sa
from harness.dw_crash import items_table
from harness.pool import pool_engine, pool_prefix
from kafka2pc.recipes.dual_write import DualWriter, Step, WriterOptions, WriterPool
from kafka2pc.recipes.dual_write._options import pool_option_problems

from kafka2pc import UsageError
from kafka2pc.testing import create_topic

ITEMS = items_table(sa.MetaData())


@pytest.mark.parametrize(("values", "option"), [
    ({"lock_timeout_s": 0}, "lock_timeout_s"),
    ({"kafka_timeout_s": -1.0}, "kafka_timeout_s"),
    ({"settle_attempts": 0}, "settle_attempts"),
    ({"queue_full_timeout_s": -1}, "queue_full_timeout_s"),
    ({"on_step": 3}, "on_step"),
])
def test_a_bad_option_is_refused_when_the_value_is_made(values: dict[str, Any], option: str) -> None:
    with pytest.raises(UsageError, match=option):
        WriterOptions(**values)


def test_options_are_frozen_and_compare_by_value() -> None:
    options = WriterOptions(retain_records=True, kafka_timeout_s=5.0)
    assert options == WriterOptions(retain_records=True, kafka_timeout_s=5.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.retain_records = False  # type: ignore[misc]


@pytest.mark.parametrize(("size", "values", "options"), [
    (4, {"max_slots": 5}, ["max_slots"]),
    (4, {"lease_s": 0, "acquire_timeout_s": -1}, ["lease_s", "acquire_timeout_s"]),
    (0, {}, ["size"]),
    (4, {"settle_parallelism": 0, "kafka_timeout_s": 0}, ["settle_parallelism", "kafka_timeout_s"]),
    (4, {"max_slots": 4, "lease_s": 2.0, "owner": "me"}, []),
])
def test_the_pool_checks_report_every_problem(size: int, values: dict[str, Any], options: list[str]) -> None:
    assert [p.option for p in pool_option_problems(size, values)] == options


def test_options_or_keywords_not_both(tmp_path: Any) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'o.db'}")
    config = {"bootstrap.servers": "127.0.0.1:1", "transactional.id": "opts"}
    writer = DualWriter(engine, config, options=WriterOptions(kafka_timeout_s=3.0))
    assert writer.options.kafka_timeout_s == 3.0
    assert DualWriter(engine, config, kafka_timeout_s=3.0).options == writer.options
    with pytest.raises(UsageError, match="not both"):
        DualWriter(engine, config, kafka_timeout_s=3.0, options=WriterOptions())
    pool = WriterPool(engine, {"bootstrap.servers": "127.0.0.1:1"}, prefix="opts", size=2, lease_s=6.0,
                      options=WriterOptions(retain_records=True), start=False)
    assert pool.options == WriterOptions(retain_records=True, lock_timeout_s=6.0)  # the pool's lock default
    assert pool.state.value == "new"
    engine.dispose()


def test_listeners_hear_every_step_of_a_writer_and_of_a_pools_writers(sqlite_url: str, kafka_bootstrap: str) -> None:
    engine = pool_engine(sqlite_url)
    topic = create_topic(kafka_bootstrap)
    prefix = pool_prefix("listen", "pool")
    on_step: list[Step] = []
    heard: list[tuple[str, Step]] = []

    def listener(writer: Any, step: Step) -> None:
        heard.append((writer.transactional_id, step))

    with pytest.raises(UsageError, match="unknown event"):
        DualWriter(engine, {"bootstrap.servers": kafka_bootstrap, "transactional.id": prefix}).add_listener(
            "commit", listener)
    with pytest.raises(UsageError, match="callable"):
        DualWriter(engine, {"bootstrap.servers": kafka_bootstrap, "transactional.id": prefix}).add_listener(
            "step", "not a function")  # type: ignore[arg-type]

    pool = WriterPool(engine, {"bootstrap.servers": kafka_bootstrap}, prefix=prefix, size=2, max_slots=1,
                      on_step=on_step.append)
    pool.add_listener("step", listener)
    try:
        with engine.connect() as conn, pool.transaction(conn) as tx:
            conn.execute(ITEMS.insert().values(id=f"{prefix}:1", series=prefix))
            tx.produce(topic, value=b"1")
        steps = [step for _, step in heard]
        assert steps[:3] == [Step.RECOVERY_LOCKED, Step.RECOVERY_CLAIMED, Step.RECOVERY_SETTLED]
        assert steps[-2:] == [Step.DB_COMMITTED, Step.KAFKA_COMMITTED] and Step.PRODUCED in steps
        assert on_step == steps  # on_step hears the same steps, after the listeners
        assert {tid for tid, _ in heard} == set(pool.held_ids)  # the slot's writer is named
        pool.remove_listener("step", listener)
        with pytest.raises(UsageError, match="not attached"):
            pool.remove_listener("step", listener)
        heard.clear()
        with engine.connect() as conn, pool.transaction(conn) as tx:
            conn.execute(ITEMS.insert().values(id=f"{prefix}:2", series=prefix))
            tx.produce(topic, value=b"2")
        assert heard == [] and on_step.count(Step.KAFKA_COMMITTED) == 2
    finally:
        pool.close()
    engine.dispose()
