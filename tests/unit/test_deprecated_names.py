"""Each deprecated 0.1 name still works, and warns with a ``DeprecationWarning`` naming its replacement.

One test per alias; none needs a broker (a call that goes on to the network
is pointed at a closed port with a short bound, and the warning comes first).
``test_every_alias_has_a_test`` keeps this module and
``kafka2pc._deprecation.RENAMED_ARGUMENTS`` in step.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import sqlalchemy as sa
from kafka2pc.recipes.dual_write import DualWriter, MissingTableError, WriterPool
from kafka2pc.recipes.dual_write.aio import AsyncDualWriter, AsyncWriterPool

import kafka2pc
from kafka2pc import BrokerUnavailableError, TransactionAdmin, UsageError
from kafka2pc._deprecation import RENAMED_ARGUMENTS, RENAMED_MEMBERS
from kafka2pc.aio import AsyncTransactionAdmin, AsyncTwoPhaseCommitProducer, LoopStallMonitor

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

UNREACHABLE = {"bootstrap.servers": "127.0.0.1:1"}
WRITER_CONFIG = {**UNREACHABLE, "transactional.id": "deprecated-names"}
TESTED: set[tuple[str, str]] = set()
_F = TypeVar("_F", bound=Callable[..., Any])


def covers(where: str, *olds: str) -> Callable[[_F], _F]:
    """Mark the test that checks the deprecated arguments ``olds`` of ``where``."""

    def mark(test: _F) -> _F:
        TESTED.update((where, old) for old in olds)
        return test

    return mark


def warns(old: str, new: str) -> Any:
    return pytest.warns(DeprecationWarning, match=rf"{re.escape(old)}.*deprecated.*kafka2pc 2\.0.*{re.escape(new)}")


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    yield engine
    engine.dispose()


def async_engine(tmp_path: Path) -> AsyncEngine:
    from sqlalchemy.ext.asyncio import create_async_engine

    return create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")


def test_topic_partition_is_topic_and_partition() -> None:
    with warns("kafka2pc.TopicPartition", "kafka2pc.TopicAndPartition"):
        alias = kafka2pc.TopicPartition
    assert alias is kafka2pc.TopicAndPartition
    assert "TopicPartition" not in kafka2pc.__all__


def test_missing_extra_is_internal() -> None:
    with warns("kafka2pc.missing_extra", "internal"):
        helper = kafka2pc.missing_extra
    assert callable(helper) and "missing_extra" not in kafka2pc.__all__


@covers("kafka2pc.TransactionAdmin.list_transactions", "min_open_ms")
def test_list_transactions_min_open_ms() -> None:
    with TransactionAdmin(UNREACHABLE, timeout_s=0.5) as admin:
        with warns("list_transactions(min_open_ms=", "min_open_s"), pytest.raises(BrokerUnavailableError):
            admin.list_transactions(min_open_ms=60_000)
        with pytest.raises(UsageError, match="not both"):
            admin.list_transactions(min_open_ms=60_000, min_open_s=60)


@covers("kafka2pc.TransactionAdmin.find_hanging_transactions", "max_transaction_timeout_ms")
def test_find_hanging_transactions_max_transaction_timeout_ms() -> None:
    with TransactionAdmin(UNREACHABLE, timeout_s=0.5) as admin:
        with warns("find_hanging_transactions(max_transaction_timeout_ms=", "max_transaction_timeout_s"):
            assert admin.find_hanging_transactions([], max_transaction_timeout_ms=0) == []


@covers("kafka2pc.aio.AsyncTransactionAdmin.list_transactions", "min_open_ms")
def test_async_list_transactions_min_open_ms() -> None:
    async def main() -> None:
        async with AsyncTransactionAdmin(UNREACHABLE, timeout_s=0.5) as admin:
            with warns("list_transactions(min_open_ms=", "min_open_s"), pytest.raises(BrokerUnavailableError):
                await admin.list_transactions(min_open_ms=0)

    asyncio.run(main())


@covers("kafka2pc.aio.AsyncTransactionAdmin.find_hanging_transactions", "max_transaction_timeout_ms")
def test_async_find_hanging_transactions_max_transaction_timeout_ms() -> None:
    async def main() -> None:
        async with AsyncTransactionAdmin(UNREACHABLE, timeout_s=0.5) as admin:
            with warns("find_hanging_transactions(max_transaction_timeout_ms=", "max_transaction_timeout_s"):
                assert await admin.find_hanging_transactions([], max_transaction_timeout_ms=0) == []

    asyncio.run(main())


@covers("kafka2pc.aio.AsyncTwoPhaseCommitProducer.__init__", "queue_full_timeout", "delivery_poll_interval")
@pytest.mark.parametrize(("old", "new"), [
    ("queue_full_timeout", "queue_full_timeout_s"),
    ("delivery_poll_interval", "delivery_poll_interval_s"),
])
def test_async_producer_argument(old: str, new: str) -> None:
    with warns(f"AsyncTwoPhaseCommitProducer({old}=", new):
        producer = AsyncTwoPhaseCommitProducer(WRITER_CONFIG, **{old: 2.5})
    if old == "queue_full_timeout":
        assert producer._queue_full_timeout == 2.5
    asyncio.run(producer.close(timeout=1))


@covers("kafka2pc.aio.LoopStallMonitor.__init__", "interval", "threshold")
@pytest.mark.parametrize(("old", "new"), [("interval", "interval_s"), ("threshold", "threshold_s")])
def test_loop_stall_monitor_argument(old: str, new: str) -> None:
    with warns(f"LoopStallMonitor({old}=", new):
        monitor = LoopStallMonitor(**{old: 0.002})
    assert (monitor.interval_s if old == "interval" else monitor._threshold) == 0.002


@covers("kafka2pc.recipes.dual_write.DualWriter.__init__", "lock_timeout_ms")
def test_dual_writer_lock_timeout_ms(engine: sa.Engine) -> None:
    with warns("DualWriter(lock_timeout_ms=", "lock_timeout_s"):
        writer = DualWriter(engine, WRITER_CONFIG, lock_timeout_ms=1500)
    assert writer.options.lock_timeout_s == 1.5
    with pytest.raises(UsageError, match="not both"):
        DualWriter(engine, WRITER_CONFIG, lock_timeout_ms=1500, lock_timeout_s=1.5)


@covers("kafka2pc.recipes.dual_write.WriterPool.__init__", "lock_timeout_ms")
def test_writer_pool_lock_timeout_ms(engine: sa.Engine) -> None:
    with warns("WriterPool(lock_timeout_ms=", "lock_timeout_s"):
        pool = WriterPool(engine, UNREACHABLE, prefix="deprecated", size=1, lock_timeout_ms=2500, start=False)
    assert pool.options.lock_timeout_s == 2.5


@covers("kafka2pc.recipes.dual_write.DualWriter.recover", "raise_on_heuristic", "acknowledge_heuristic")
@pytest.mark.parametrize(("old", "value", "new"), [
    ("raise_on_heuristic", False, "on_heuristic='raise' or 'report'"),
    ("acknowledge_heuristic", True, "on_heuristic='acknowledge'"),
])
def test_dual_writer_recover_flag(engine: sa.Engine, old: str, value: bool, new: str) -> None:
    writer = DualWriter(engine, WRITER_CONFIG)  # no state table: recover stops there, before Kafka
    with warns(f"DualWriter.recover({old}=", new), pytest.raises(MissingTableError):
        writer.recover(**{old: value})
    with pytest.raises(UsageError, match="not both"):
        writer.recover(on_heuristic="report", **{old: value})


def test_recover_refuses_an_unknown_on_heuristic(engine: sa.Engine) -> None:
    with pytest.raises(UsageError, match="on_heuristic must be one of 'raise', 'report', 'acknowledge'"):
        DualWriter(engine, WRITER_CONFIG).recover(on_heuristic="ignore")  # type: ignore[arg-type]


@covers("kafka2pc.recipes.dual_write.aio.AsyncDualWriter.__init__", "lock_timeout_ms")
def test_async_dual_writer_lock_timeout_ms(tmp_path: Path) -> None:
    with warns("AsyncDualWriter(lock_timeout_ms=", "lock_timeout_s"):
        writer = AsyncDualWriter(async_engine(tmp_path), WRITER_CONFIG, lock_timeout_ms=1500)
    assert writer.options.lock_timeout_s == 1.5


@covers("kafka2pc.recipes.dual_write.aio.AsyncWriterPool.__init__", "lock_timeout_ms")
def test_async_writer_pool_lock_timeout_ms(tmp_path: Path) -> None:
    with warns("AsyncWriterPool(lock_timeout_ms=", "lock_timeout_s"):
        pool = AsyncWriterPool(async_engine(tmp_path), UNREACHABLE, prefix="deprecated", size=1,
                               lock_timeout_ms=2500)
    assert pool.options.lock_timeout_s == 2.5


@covers("kafka2pc.recipes.dual_write.aio.AsyncDualWriter.recover", "raise_on_heuristic", "acknowledge_heuristic")
@pytest.mark.parametrize(("old", "value", "new"), [
    ("raise_on_heuristic", False, "on_heuristic='raise' or 'report'"),
    ("acknowledge_heuristic", True, "on_heuristic='acknowledge'"),
])
def test_async_dual_writer_recover_flag(tmp_path: Path, old: str, value: bool, new: str) -> None:
    async def main() -> None:
        engine = async_engine(tmp_path)
        writer = AsyncDualWriter(engine, WRITER_CONFIG)
        try:
            with warns(f"AsyncDualWriter.recover({old}=", new), pytest.raises(MissingTableError):
                await writer.recover(**{old: value})
        finally:
            await writer.close()
            await engine.dispose()

    asyncio.run(main())


@pytest.mark.parametrize("old", ["state_table", "outbox_table", "lease_table"])
def test_table_function_is_define_table(old: str) -> None:
    import kafka2pc.recipes.dual_write as dual_write

    new = f"define_{old}"
    with warns(f"kafka2pc.recipes.dual_write.{old}", f"kafka2pc.recipes.dual_write.{new}"):
        alias = getattr(dual_write, old)
    assert alias is getattr(dual_write, new) and old not in dual_write.__all__
    table = alias(sa.MetaData())
    assert isinstance(table, sa.Table)


def test_every_alias_has_a_test() -> None:
    assert {(where, old) for where, old, _ in RENAMED_ARGUMENTS} == TESTED


def upgrade_table() -> dict[str, str]:
    """The rows of docs/upgrading.md's table of renamed names: old name -> replacement (``none``: no replacement)."""
    page = Path(__file__).resolve().parents[2] / "docs" / "upgrading.md"
    rows: dict[str, str] = {}
    for line in page.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            old, new = cells[0].strip("`"), cells[1].strip("`")
            assert old not in rows, f"{old} is listed twice"
            rows[old] = new
    return rows


def test_upgrade_table_lists_every_deprecated_name() -> None:
    """docs/upgrading.md names each deprecated alias and its replacement, and nothing else."""
    import inspect

    import kafka2pc.recipes.dual_write as dual_write

    expected = {
        f"{where.removesuffix('.__init__')}({old}=)": new for where, old, new in RENAMED_ARGUMENTS
    }
    for name, (_, _, replacement) in kafka2pc._DEPRECATED.items():
        expected[f"kafka2pc.{name}"] = replacement if replacement.startswith("kafka2pc.") else "none"
    for name, (_, replacement) in dual_write._RENAMED.items():
        expected[f"kafka2pc.recipes.dual_write.{name}"] = replacement
    for old, new, _ in RENAMED_MEMBERS:
        expected[old] = new
    from kafka2pc.recipes.spark import KafkaTwoPhaseSink

    if "faults" in inspect.signature(KafkaTwoPhaseSink).parameters:  # deprecated, warns in its constructor
        expected["kafka2pc.recipes.spark.KafkaTwoPhaseSink(faults=)"] = "none"
    assert upgrade_table() == expected


@covers("kafka2pc.TwoPhaseCommitProducer.produce", "callback")
def test_produce_callback_is_on_delivery() -> None:
    """Checked before the producer is started: the warning comes first, then the state machine refuses."""
    producer = kafka2pc.TwoPhaseCommitProducer(WRITER_CONFIG)
    try:
        with warns("produce(callback=", "on_delivery"), pytest.raises(kafka2pc.IllegalStateError):
            producer.produce("t", b"v", callback=lambda err, msg: None)
    finally:
        producer.close(timeout=0.5)


@covers("kafka2pc.TransactionAdmin.complete_transaction", "raise_on_heuristic")
@covers("kafka2pc.TransactionAdmin.settle_many", "raise_on_heuristic")
@pytest.mark.parametrize("method", ["complete_transaction", "settle_many"])
def test_admin_raise_on_heuristic(method: str) -> None:
    state = kafka2pc.PreparedTxnState()
    with TransactionAdmin(UNREACHABLE, timeout_s=0.5) as admin:
        call = (lambda **kw: admin.complete_transaction("t", state, **kw)) if method == "complete_transaction" else (
            lambda **kw: admin.settle_many({"t": state}, **kw))
        with warns(f"{method}(raise_on_heuristic=", "on_heuristic"), pytest.raises(BrokerUnavailableError):
            call(raise_on_heuristic=False)
        with pytest.raises(UsageError, match="on_heuristic"):
            call(on_heuristic="ignore")


@covers("kafka2pc.aio.AsyncTransactionAdmin.complete_transaction", "raise_on_heuristic")
@covers("kafka2pc.aio.AsyncTransactionAdmin.settle_many", "raise_on_heuristic")
@pytest.mark.parametrize("method", ["complete_transaction", "settle_many"])
def test_async_admin_raise_on_heuristic(method: str) -> None:
    state = kafka2pc.PreparedTxnState()

    async def main() -> None:
        async with AsyncTransactionAdmin(UNREACHABLE, timeout_s=0.5) as admin:
            with warns(f"{method}(raise_on_heuristic=", "on_heuristic"), pytest.raises(BrokerUnavailableError):
                if method == "complete_transaction":
                    await admin.complete_transaction("t", state, raise_on_heuristic=True)
                else:
                    await admin.settle_many({"t": state}, raise_on_heuristic=True)

    asyncio.run(main())


def test_renamed_error_is_the_core_error() -> None:
    import kafka2pc.recipes.dual_write as dual_write

    with warns("kafka2pc.recipes.dual_write.TopicNotFoundError", "kafka2pc.UnknownTopicError"):
        alias = dual_write.TopicNotFoundError
    assert alias is kafka2pc.UnknownTopicError and "TopicNotFoundError" not in dual_write.__all__


def _deprecated_members() -> set[str]:
    import importlib
    import inspect

    found = set()
    for module_name in ("kafka2pc", "kafka2pc.aio", "kafka2pc.recipes.dual_write", "kafka2pc.recipes.dual_write.aio",
                        "kafka2pc.recipes.spark"):
        module = importlib.import_module(module_name)
        for name in module.__all__:
            cls = getattr(module, name)
            if not inspect.isclass(cls):
                continue
            for member, static in vars(cls).items():
                target = static.fget if isinstance(static, property) else static
                if getattr(target, "__deprecated__", None) is not None:
                    found.add(f"{module_name}.{name}.{member}" + ("" if isinstance(static, property) else "()"))
    return found


def test_every_deprecated_member_is_registered() -> None:
    assert _deprecated_members() == {old for old, _, _ in RENAMED_MEMBERS}


def test_deprecated_members_warn_and_keep_their_values() -> None:
    from kafka2pc import OpenTransaction, ProducerState, TopicAndPartition, TransactionDescription, TransactionInfo

    desc = TransactionDescription("t", "Ongoing", 1, 0, 60_000, 1, (), 0)
    info = TransactionInfo(desc, 2.5, ())
    with warns("TransactionInfo.open_for_ms", "open_for_s"):
        assert info.open_for_ms == 2500
    with warns("TransactionInfo.open_for_ms", "open_for_s"):
        assert TransactionInfo(desc, None, ()).open_for_ms == -1
    hanging = OpenTransaction(TopicAndPartition("t", 0), ProducerState(1, 0, 0, 0, 0, 0), 1.25, None, None, True, "r")
    with warns("OpenTransaction.duration_ms", "duration_s"):
        assert hanging.duration_ms == 1250
    with TransactionAdmin(UNREACHABLE, timeout_s=0.5) as admin:
        with warns("max_transaction_timeout_ms()", "max_transaction_timeout_s()"), pytest.raises(BrokerUnavailableError):
            admin.max_transaction_timeout_ms()
        with warns("outcome_of()", "transaction_outcome()"):
            assert admin.outcome_of(kafka2pc.PreparedTxnState()) is kafka2pc.TransactionOutcome.NONE


def test_writer_status_is_state(engine: sa.Engine) -> None:
    writer = DualWriter(engine, WRITER_CONFIG)
    with warns("DualWriter.status", "DualWriter.state"):
        assert writer.status is writer.state


def test_flush_without_a_bound_is_deprecated_and_close_refuses_a_negative_timeout(engine: sa.Engine) -> None:
    producer = kafka2pc.TwoPhaseCommitProducer(WRITER_CONFIG)
    try:
        with warns("flush(timeout=-1)", "flush(timeout=<seconds>)"), pytest.raises(kafka2pc.IllegalStateError):
            producer.flush(-1)
    finally:
        producer.close(timeout=0.5)
    with TransactionAdmin(UNREACHABLE) as admin, pytest.raises(UsageError, match="not negative"):
        admin.close(timeout=-1)
    with pytest.raises(UsageError, match="not negative"):
        DualWriter(engine, WRITER_CONFIG).close(timeout=-1)
