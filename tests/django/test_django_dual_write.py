"""kafka2pc.recipes.django on a real broker and real SQLite, PostgreSQL and MariaDB (pytest-django).

The write, its rollback paths, misuse and bad input (each a typed error that changes nothing), the state
table shared with the SQLAlchemy recipe and the CLI, recovery, the admin page and the async twin.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import sqlalchemy as sa
from django.core.management import call_command
from django.db import connections, transaction
from djtest.models import Item
from djtest.params import on
from kafka2pc.recipes.django import MigrationMissingError, NestedAtomicError, adual_write, close, dual_write, recover
from kafka2pc.recipes.django.models import TransactionState, WriterLease
from kafka2pc.recipes.dual_write import TransactionMisuseError

from kafka2pc import Kafka2pcError, UsageError
from kafka2pc.testing import drain, end_offsets, settled_end_offsets


def _records(bootstrap: str, topic: str) -> list[str]:
    return sorted(r.value.decode() for r in drain(bootstrap, topic, "read_committed") if r.value)


def _rows(alias: str) -> list[str]:
    return sorted(Item.objects.using(alias).values_list("id", flat=True))


def _nothing_open(bootstrap: str, topic: str) -> None:
    assert settled_end_offsets(bootstrap, topic) == end_offsets(bootstrap, topic, "read_uncommitted")


def _write(alias: str, topic: str, rid: str) -> None:
    with dual_write(using=alias) as tx:
        Item.objects.using(alias).create(id=rid, series="s")
        tx.produce(topic, value=rid.encode(), key=rid.encode())


def _clean(alias: str) -> None:
    conn = connections[alias]
    assert conn.get_autocommit() and not conn.in_atomic_block and not conn.needs_rollback


def _visible(bootstrap: str, topic: str, pipelined: bool) -> list[str]:
    """The ``read_committed`` records; pipelined, after closing the pools (which drains their Kafka commits)."""
    if pipelined:
        close()
    return _records(bootstrap, topic)


def test_rows_and_records_commit_together(alias: str, pipelined: bool, kafka_bootstrap: str,
                                          topic_factory: Any) -> None:
    topic = topic_factory()
    committed: list[str] = []
    with dual_write(using=alias) as tx:
        Item.objects.using(alias).create(id="a", series="s")
        tx.produce(topic, value=b"a", key=b"a")
        transaction.on_commit(lambda: committed.append("a"), using=alias)
        with transaction.atomic(using=alias):  # a savepoint inside the block is fine
            Item.objects.using(alias).create(id="a2", series="s")
            tx.produce(topic, value=b"a2", key=b"a2")
    _write(alias, topic, "b")
    assert _rows(alias) == ["a", "a2", "b"]
    # Django's on_commit callbacks run once both sides committed (pipelined: once the database did)
    assert committed == ["a"]
    assert _visible(kafka_bootstrap, topic, pipelined) == ["a", "a2", "b"]
    _clean(alias)
    # The state row is the SQLAlchemy recipe's: its stored state names the last transaction.
    states = list(TransactionState.objects.using(alias).exclude(prepared_txn_state=None))
    # pipelined, the second block may run on another id while the first one's Kafka commit is in flight
    assert len(states) in ({1, 2} if pipelined else {1})
    assert all(s.transactional_id.startswith("dj-") for s in states)
    _nothing_open(kafka_bootstrap, topic)


def test_an_exception_rolls_back_both_sides(alias: str, pipelined: bool, kafka_bootstrap: str,
                                           topic_factory: Any) -> None:
    topic = topic_factory()
    called: list[str] = []
    with pytest.raises(ZeroDivisionError):
        with dual_write(using=alias) as tx:
            Item.objects.using(alias).create(id="x", series="s")
            tx.produce(topic, value=b"x", key=b"x")
            transaction.on_commit(lambda: called.append("x"), using=alias)
            1 / 0  # noqa: B018
    _clean(alias)
    _write(alias, topic, "after")
    assert _rows(alias) == ["after"] and _visible(kafka_bootstrap, topic, pipelined) == ["after"] and called == []
    _nothing_open(kafka_bootstrap, topic)


@pytest.mark.parametrize("alias", on("default", "pg"), indirect=True)
def test_a_pipelined_block_returns_at_the_database_commit_and_wait_visible_waits_for_kafka(
    alias: str, k2pc_settings: dict[str, Any], kafka_bootstrap: str, topic_factory: Any
) -> None:
    from kafka2pc.recipes.django._runtime import runtime_for

    k2pc_settings["POOL_OPTIONS"].update(pipelined=True, max_in_flight=2)
    topic = topic_factory()
    with dual_write(using=alias, wait_visible=True) as tx:
        Item.objects.using(alias).create(id="v", series="s")
        tx.produce(topic, value=b"v", key=b"v")
    pool = runtime_for(alias).pool
    assert pool.metrics().commits_in_flight == 0 and _records(kafka_bootstrap, topic) == ["v"]
    committed: list[str] = []
    with dual_write(using=alias) as tx:
        Item.objects.using(alias).create(id="p", series="s")
        tx.produce(topic, value=b"p", key=b"p")
        transaction.on_commit(lambda: committed.append("p"), using=alias)
    assert _rows(alias) == ["p", "v"] and committed == ["p"]  # the database committed when the block returned
    _clean(alias)

    async def main() -> None:
        async with adual_write(using=alias, wait_visible=True) as atx:
            await Item.objects.using(alias).acreate(id="av", series="s")
            await atx.produce(topic, value=b"av", key=b"av")
        from asgiref.sync import sync_to_async

        await sync_to_async(connections.close_all)()

    asyncio.run(main())
    assert "av" in _records(kafka_bootstrap, topic)
    close()  # drains the Kafka commits still in flight, then gives the leases back
    assert pool.metrics().commits_in_flight == 0
    assert _records(kafka_bootstrap, topic) == ["av", "p", "v"]
    assert pool.metrics().transactions.transactions_committed == 3
    _nothing_open(kafka_bootstrap, topic)


def test_set_rollback_aborts_quietly(alias: str, kafka_bootstrap: str, topic_factory: Any) -> None:
    topic = topic_factory()
    with dual_write(using=alias) as tx:
        Item.objects.using(alias).create(id="x", series="s")
        tx.produce(topic, value=b"x", key=b"x")
        transaction.set_rollback(True, using=alias)
    _clean(alias)
    _write(alias, topic, "after")
    assert _rows(alias) == ["after"] and _records(kafka_bootstrap, topic) == ["after"]
    _nothing_open(kafka_bootstrap, topic)


def test_inside_another_atomic_block_it_fails_at_once(alias: str, kafka_bootstrap: str, topic_factory: Any) -> None:
    topic = topic_factory()
    with transaction.atomic(using=alias):
        Item.objects.using(alias).create(id="outer", series="s")
        with pytest.raises(NestedAtomicError, match="outermost") as raised:
            with dual_write(using=alias):
                pytest.fail("the block must not run")  # pragma: no cover
    assert "@transaction.non_atomic_requests" in str(raised.value)  # the way out of ATOMIC_REQUESTS

    @transaction.atomic(using=alias)
    def view() -> None:  # what ATOMIC_REQUESTS makes of a view: the error names the decorator and the alias
        with dual_write(using=alias):
            pytest.fail("the block must not run")  # pragma: no cover

    connections[alias].settings_dict["ATOMIC_REQUESTS"] = True
    try:
        with pytest.raises(NestedAtomicError, match=r"ATOMIC_REQUESTS'\] is on: decorate the view with "
                                                    r"@transaction.non_atomic_requests"):
            view()
    finally:
        connections[alias].settings_dict["ATOMIC_REQUESTS"] = False
    assert isinstance(NestedAtomicError("x"), TransactionMisuseError)
    assert _rows(alias) == ["outer"]  # the enclosing block was not disturbed
    assert not WriterLease.objects.using(alias).exclude(owner=None).exists()  # no id was leased
    _write(alias, topic, "after")
    assert _records(kafka_bootstrap, topic) == ["after"]


def test_an_unknown_alias_is_a_typed_error(k2pc_settings: dict[str, Any]) -> None:
    with pytest.raises(UsageError, match="no database 'nope'"):
        with dual_write(using="nope"):
            pytest.fail("the block must not run")  # pragma: no cover


def test_commit_inside_the_block_cannot_break_atomicity(alias: str, kafka_bootstrap: str, topic_factory: Any) -> None:
    topic = topic_factory()
    # transaction.commit(): Django refuses it inside atomic; the block then fails and rolls back both sides.
    with pytest.raises(Exception, match="forbidden when an 'atomic' block is active"):
        with dual_write(using=alias) as tx:
            Item.objects.using(alias).create(id="c1", series="s")
            tx.produce(topic, value=b"c1", key=b"c1")
            transaction.commit(using=alias)
    # A raw COMMIT is refused before it is sent, and the block fails even if the application swallows it.
    with pytest.raises(TransactionMisuseError, match="COMMIT"):
        with dual_write(using=alias) as tx:
            Item.objects.using(alias).create(id="c2", series="s")
            tx.produce(topic, value=b"c2", key=b"c2")
            try:
                with connections[alias].cursor() as cursor:
                    cursor.execute("COMMIT")
            except TransactionMisuseError:
                pass
            Item.objects.using(alias).create(id="c3", series="s")
    _clean(alias)
    assert _rows(alias) == [] and _records(kafka_bootstrap, topic) == []
    _write(alias, topic, "after")
    assert _rows(alias) == ["after"] and _records(kafka_bootstrap, topic) == ["after"]
    _nothing_open(kafka_bootstrap, topic)


def test_unknown_topic_is_a_typed_error_that_changes_nothing(alias: str, kafka_bootstrap: str,
                                                            topic_factory: Any) -> None:
    topic = topic_factory()
    started = time.monotonic()
    with pytest.raises(Kafka2pcError) as raised:
        with dual_write(using=alias) as tx:
            Item.objects.using(alias).create(id="u", series="s")
            tx.produce("no-such-topic-k2pc-dj", value=b"u")
    # the dual write's unknown-topic error (TopicNotFoundError; kafka2pc.UnknownTopicError in 1.0)
    assert isinstance(raised.value, UsageError) and "no-such-topic-k2pc-dj" in str(raised.value)
    assert time.monotonic() - started < 30
    _clean(alias)
    assert _rows(alias) == []
    _write(alias, topic, "after")
    assert _records(kafka_bootstrap, topic) == ["after"]


@pytest.mark.parametrize("alias", on("default", "pg"), indirect=True)
def test_unreachable_broker_is_a_typed_error_in_bounded_time(alias: str, k2pc_settings: dict[str, Any]) -> None:
    from kafka2pc.recipes.django._runtime import close_all

    close_all()
    k2pc_settings["PRODUCER"] = {"bootstrap.servers": "127.0.0.1:9"}  # nothing listens there
    k2pc_settings["POOL_OPTIONS"] = {**k2pc_settings["POOL_OPTIONS"], "acquire_timeout_s": 5.0,
                                     "kafka_timeout_s": 5.0}
    started = time.monotonic()
    with pytest.raises(Kafka2pcError) as raised:
        with dual_write(using=alias):
            Item.objects.using(alias).create(id="n", series="s")
    elapsed = time.monotonic() - started
    assert elapsed < 30, elapsed
    print(f"\nunreachable broker: {type(raised.value).__name__} after {elapsed:.1f} s: {raised.value}")
    _clean(alias)
    assert _rows(alias) == []


@pytest.mark.parametrize("alias", on("default", "pg", "maria"), indirect=True)
def test_missing_migration_is_a_typed_error_that_changes_nothing(alias: str) -> None:
    call_command("migrate", "kafka2pc", "zero", database=alias, verbosity=0)
    try:
        with pytest.raises(MigrationMissingError, match="migrate kafka2pc"):
            with dual_write(using=alias):
                Item.objects.using(alias).create(id="m", series="s")  # pragma: no cover
        _clean(alias)
        assert _rows(alias) == []
    finally:
        call_command("migrate", "kafka2pc", database=alias, verbosity=0)


def _sa_url(alias: str) -> str:
    s = connections[alias].settings_dict
    vendor = connections[alias].vendor
    if vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    driver = {"postgresql": "postgresql+psycopg", "mysql": "mysql+pymysql"}[vendor]
    return sa.URL.create(driver, s["USER"], s["PASSWORD"], s["HOST"], int(s["PORT"]), s["NAME"]).render_as_string(
        hide_password=False)


def test_the_cli_and_the_sqlalchemy_recipe_read_the_state_table(alias: str, kafka_bootstrap: str,
                                                                topic_factory: Any) -> None:
    from click.testing import CliRunner
    from kafka2pc.cli import cli
    from kafka2pc.recipes.dual_write import DualWriter

    topic = topic_factory()
    _write(alias, topic, "a")
    tid = TransactionState.objects.using(alias).exclude(prepared_txn_state=None).get().transactional_id
    result = CliRunner().invoke(cli, ["in-doubt", "--db-url", _sa_url(alias), "-b", kafka_bootstrap, "-o", "json"])
    assert result.exit_code == 0, result.output
    entries = {e["transactional_id"]: e for e in json.loads(result.output)["entries"]}
    assert entries[tid]["decision"] == "nothing", entries[tid]  # committed on both sides
    # The SQLAlchemy recipe's writer works on the same table and database, with its own id.
    engine = sa.create_engine(_sa_url(alias), poolclass=sa.pool.NullPool)
    try:
        with DualWriter(engine, {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"{tid}-sa"}) as writer:
            writer.recover()
            with engine.connect() as conn, writer.transaction(conn) as tx:
                conn.execute(sa.text("INSERT INTO dw_items (id, series) VALUES ('sa', 's')"))
                tx.produce(topic, value=b"sa", key=b"sa")
    finally:
        engine.dispose()
    assert _rows(alias) == ["a", "sa"] and _records(kafka_bootstrap, topic) == ["a", "sa"]


def test_recover_and_the_management_command(alias: str, kafka_bootstrap: str, topic_factory: Any,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    topic = topic_factory()
    assert recover(alias) == []  # nothing left by anyone
    _write(alias, topic, "a")
    call_command("kafka2pc_recover", database=[alias], json=True)
    document = json.loads(capsys.readouterr().out)
    assert document["settled"] == [] and document["exit_code"] == 0
    call_command("kafka2pc_recover", database=[alias], json=True, dry_run=True)  # the last write is settled
    document = json.loads(capsys.readouterr().out)
    assert document["in_doubt"] == [] and document["dry_run"] is True
    _write(alias, topic, "b")  # the command closed this process's pool; the next write makes a new one
    assert _records(kafka_bootstrap, topic) == ["a", "b"]


@pytest.mark.parametrize("alias", on("default", "pg"), indirect=True)
def test_async_dual_write(alias: str, kafka_bootstrap: str, topic_factory: Any) -> None:
    topic = topic_factory()

    async def main() -> None:
        async with adual_write(using=alias) as tx:
            await Item.objects.using(alias).acreate(id="async-1", series="s")
            await tx.produce(topic, value=b"async-1", key=b"async-1")
        with pytest.raises(ValueError):
            async with adual_write(using=alias) as tx:
                await Item.objects.using(alias).acreate(id="async-2", series="s")
                await tx.produce(topic, value=b"async-2", key=b"async-2")
                raise ValueError("rolled back")
        from asgiref.sync import sync_to_async

        await sync_to_async(connections.close_all)()  # the executor thread's connection (the test DB is dropped)

    asyncio.run(main())
    assert _rows(alias) == ["async-1"] and _records(kafka_bootstrap, topic) == ["async-1"]
    _nothing_open(kafka_bootstrap, topic)


@pytest.mark.parametrize("alias", on("default"), indirect=True)
def test_admin_page_lists_states_read_only(alias: str, kafka_bootstrap: str, topic_factory: Any,
                                           admin_client: Any) -> None:
    topic = topic_factory()
    _write(alias, topic, "a")
    tid = TransactionState.objects.exclude(prepared_txn_state=None).get().transactional_id
    page = admin_client.get("/admin/kafka2pc/transactionstate/?stored=yes")
    assert page.status_code == 200 and tid in page.content.decode()
    assert admin_client.get("/admin/kafka2pc/transactionstate/add/").status_code == 403
    assert admin_client.get("/admin/kafka2pc/writerlease/").status_code == 200


@pytest.mark.parametrize("alias", on("pg", "maria"), indirect=True)
def test_retain_records_uses_the_migrated_outbox_table(alias: str, kafka_bootstrap: str, topic_factory: Any,
                                                      k2pc_settings: dict[str, Any]) -> None:
    from kafka2pc.recipes.django import close

    close()
    k2pc_settings["POOL_OPTIONS"] = {**k2pc_settings["POOL_OPTIONS"], "retain_records": True}
    topic = topic_factory()
    _write(alias, topic, "r1")
    _write(alias, topic, "r2")
    assert _rows(alias) == ["r1", "r2"] and _records(kafka_bootstrap, topic) == ["r1", "r2"]
    with connections[alias].cursor() as cursor:  # the outbox keeps the last transaction's records until the next
        cursor.execute("SELECT count(*) FROM kafka_transaction_outbox")
        assert cursor.fetchone()[0] <= 1


@pytest.mark.django_db(transaction=True, databases=["default", "pg"])
def test_a_write_to_another_alias_in_the_block_is_refused(k2pc_settings: dict[str, Any], kafka_bootstrap: str,
                                                          topic_factory: Any) -> None:
    topic = topic_factory()
    with pytest.raises(TransactionMisuseError, match="database 'default' inside `with dual_write\\(using='pg'\\)`"):
        with dual_write(using="pg") as tx:
            Item.objects.using("pg").create(id="in-block", series="s")
            tx.produce(topic, value=b"in-block")
            assert list(Item.objects.using("default").values_list("id", flat=True)) == []  # reads go through
            try:
                Item.objects.using("default").create(id="elsewhere", series="s")  # a router's choice, say
            except TransactionMisuseError:
                pass  # swallowed: the block fails all the same
    assert _rows("default") == [] and _rows("pg") == []  # neither the escaped write nor the block's row
    assert _records(kafka_bootstrap, topic) == []
    _clean("pg")
    Item.objects.using("default").create(id="after", series="s")  # the guard ended with the block
    _write("pg", topic, "after")
    assert _rows("default") == ["after"] and _records(kafka_bootstrap, topic) == ["after"]


@pytest.mark.parametrize("alias", on("default", "pg"), indirect=True)
def test_the_management_commands_errors_are_one_line_with_the_clis_exit_codes(
        alias: str, k2pc_settings: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from kafka2pc.cli import ExitCode
    from kafka2pc.recipes.django._runtime import close_all
    from kafka2pc.recipes.django.management.commands.kafka2pc_recover import EXIT_CODES

    assert EXIT_CODES == {name: int(ExitCode[name]) for name in EXIT_CODES}

    def run(*args: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as exited:
            call_command("kafka2pc_recover", "--database", alias, *args)
        out, err = capsys.readouterr()
        return int(exited.value.code or 0), out, err

    call_command("migrate", "kafka2pc", "zero", database=alias, verbosity=0)
    try:
        code, out, err = run()
        assert code == ExitCode.DATABASE and err.count("\n") == 1 and "migration missing" in err, err
        code, out, _ = run("--json")
        document = json.loads(out)
        assert code == 7 and document["error"]["name"] == "DATABASE"
    finally:
        call_command("migrate", "kafka2pc", database=alias, verbosity=0)
    close_all()
    k2pc_settings["PRODUCER"] = {"bootstrap.servers": "127.0.0.1:9"}  # nothing listens there
    k2pc_settings["POOL_OPTIONS"] = {**k2pc_settings["POOL_OPTIONS"], "kafka_timeout_s": 3.0}
    with connections[alias].cursor() as cursor:
        prefix = k2pc_settings["TRANSACTIONAL_ID_PREFIX"] + ("" if alias == "default" else f".{alias}")
        cursor.execute("INSERT INTO kafka_writer_lease (transactional_id, pool, owner, expires_at, epoch) "
                       "VALUES (%s, %s, NULL, NULL, 0)", [f"{prefix}-0", prefix])
        cursor.execute("INSERT INTO kafka_transaction_state (transactional_id, prepared_txn_state) VALUES (%s, %s)",
                       [f"{prefix}-0", "5:0"])  # a state in the Java form
    code, out, err = run("--dry-run")
    assert code == ExitCode.UNREACHABLE and err.count("\n") == 1 and "Kafka unreachable" in err, (code, err)


@pytest.mark.parametrize("alias", on("default"), indirect=True)
def test_the_health_check_sees_a_pool_that_cannot_reach_kafka(alias: str, k2pc_settings: dict[str, Any],
                                                              kafka_bootstrap: str, topic_factory: Any,
                                                              client: Any) -> None:
    from kafka2pc.recipes.django.health import HEALTH_TIMEOUT_S

    answer = client.get("/health/kafka2pc")
    assert answer.status_code == 200 and answer.json()["pool"] is None  # no pool made by the check
    _write(alias, topic_factory(), "a")
    answer = client.get("/health/kafka2pc")
    assert answer.status_code == 200 and answer.json()["pool"]["transactions"]["transactions_committed"] == 1
    from kafka2pc.recipes.django._runtime import close_all

    close_all()
    k2pc_settings["PRODUCER"] = {"bootstrap.servers": "127.0.0.1:9"}  # nothing listens there
    started = time.monotonic()
    answer = client.get("/health/kafka2pc")
    assert answer.status_code == 503 and answer.json()["ok"] is False and answer.json()["kafka"]
    assert time.monotonic() - started < HEALTH_TIMEOUT_S + 5
