"""The Django app's pure logic, no database and no broker: the statement guard and the setting's checks."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.checks import Error
from kafka2pc.recipes.django import ConfigurationError
from kafka2pc.recipes.django._checks import OPTION_CHECK_IDS, check_settings
from kafka2pc.recipes.django._guard import OtherAliasGuard, StatementGuard
from kafka2pc.recipes.django._settings import read_settings
from kafka2pc.recipes.dual_write import TransactionMisuseError

from kafka2pc import UsageError

ENDS = ["COMMIT", "commit;", "  COMMIT WORK", "END", "ROLLBACK", "rollback work", "ABORT", "BEGIN",
        "START TRANSACTION", "PREPARE TRANSACTION 'x'", "XA START 'x'", "INSERT INTO t VALUES (1); COMMIT",
        "SELECT 1;\n  rollback", "SELECT 1; SELECT 2;\tCOMMIT"]
ALLOWED = ["SELECT 1", 'SAVEPOINT "s1"', 'RELEASE SAVEPOINT "s1"', 'ROLLBACK TO SAVEPOINT "s1"',
           "ROLLBACK WORK TO SAVEPOINT s1", "INSERT INTO t (note) VALUES ('begin')",
           "UPDATE t SET endpoint = 1", "SELECT CASE WHEN a THEN 1 ELSE 2 END FROM t", "CREATE TABLE t (id int)"]
MYSQL_ONLY = ["CREATE TABLE t (id int)", "ALTER TABLE t ADD c int", "DROP TABLE t", "TRUNCATE t", "RENAME TABLE a TO b",
              "LOCK TABLES t WRITE", "SET autocommit = 1", "SET SESSION autocommit=1", "set @@autocommit = 1"]


def _run(guard: StatementGuard, sql: str) -> list[str]:
    sent: list[str] = []
    guard(lambda s, p, m, c: sent.append(s), sql, None, False, {})
    return sent


@pytest.mark.parametrize("sql", ENDS)
def test_statements_that_end_the_transaction_are_refused_before_they_are_sent(sql: str) -> None:
    guard = StatementGuard("postgresql", "default")
    with pytest.raises(TransactionMisuseError, match="was not sent"):
        _run(guard, sql)
    assert guard.refused is not None  # remembered: the block fails at its end even if the error was caught


@pytest.mark.parametrize("sql", ALLOWED)
def test_savepoints_and_ordinary_statements_go_through(sql: str) -> None:
    guard = StatementGuard("postgresql", "default")
    assert _run(guard, sql) == [sql] and guard.refused is None


@pytest.mark.parametrize("sql", MYSQL_ONLY)
def test_implicit_commits_are_refused_on_mysql_only(sql: str) -> None:
    with pytest.raises(TransactionMisuseError):
        _run(StatementGuard("mysql", "default"), sql)
    assert _run(StatementGuard("sqlite", "default"), sql) == [sql]


GOOD: dict[str, Any] = {"PRODUCER": {"bootstrap.servers": "k:9092"}, "TRANSACTIONAL_ID_PREFIX": "orders",
                        "POOL_SIZE": 4}


def test_a_good_setting_is_read() -> None:
    s = read_settings({**GOOD, "POOL_OPTIONS": {"lease_s": 5.0}})
    assert (s.prefix, s.pool_size, dict(s.pool_options)) == ("orders", 4, {"lease_s": 5.0})
    assert s.prefix_for("default") == "orders" and s.prefix_for("replica") == "orders.replica"
    assert read_settings({k: v for k, v in GOOD.items() if k != "POOL_SIZE"}).pool_size == 8


@pytest.mark.parametrize(("change", "names"), [
    (None, "must be a dict"),
    ({"EXTRA": 1}, "unknown keys"),
    ({"PRODUCER": {}}, "bootstrap.servers"),
    ({"PRODUCER": {"bootstrap.servers": "k", "transactional.id": "x"}}, "must not set 'transactional.id'"),
    ({"TRANSACTIONAL_ID_PREFIX": ""}, "TRANSACTIONAL_ID_PREFIX"),
    ({"POOL_SIZE": 0}, "POOL_SIZE"),
    ({"POOL_SIZE": True}, "POOL_SIZE"),
    ({"POOL_OPTIONS": {"pipelined_commit": True}}, "unknown keys"),
    ({"POOL_OPTIONS": {"pipelined": "yes"}}, "must be True or False"),
])
def test_a_bad_setting_is_a_typed_error_naming_the_key(change: dict[str, Any] | None, names: str) -> None:
    value = None if change is None else {**GOOD, **change}
    with pytest.raises(ConfigurationError, match=names) as raised:
        read_settings(value)
    assert isinstance(raised.value, UsageError)


def test_the_system_check_reports_a_bad_setting(settings: Any) -> None:
    settings.KAFKA2PC = {**GOOD, "POOL_SIZE": -1}
    (error,) = check_settings()
    assert isinstance(error, Error) and error.id == "kafka2pc.E001" and "POOL_SIZE" in error.msg
    settings.KAFKA2PC = GOOD
    assert check_settings() == []


def test_atomic_requests_is_a_warning_per_alias(settings: Any) -> None:
    from django.core.checks import Warning, run_checks

    assert not [m for m in run_checks() if m.id == "kafka2pc.W001"]
    settings.DATABASES = {**settings.DATABASES, "pg": {**settings.DATABASES["pg"], "ATOMIC_REQUESTS": True}}
    (warning,) = [m for m in run_checks() if m.id == "kafka2pc.W001"]  # manage.py check runs it (no --database)
    assert isinstance(warning, Warning) and "'pg'" in warning.msg
    assert "@transaction.non_atomic_requests" in (warning.hint or "")


@pytest.mark.parametrize("sql", ["INSERT INTO t VALUES (1)", "  update t set a = 1", "DELETE FROM t",
                                 "/* router */ INSERT INTO t VALUES (1)", "TRUNCATE t", "CREATE TABLE x (a int)"])
def test_writes_to_another_alias_are_refused(sql: str) -> None:
    guard = OtherAliasGuard("other", "default")
    with pytest.raises(TransactionMisuseError, match="outside the two-phase commit"):
        guard(lambda *a: pytest.fail("sent"), sql, None, False, {})
    assert guard.refused is not None


@pytest.mark.parametrize("sql", ["SELECT 1", "select * from t where a = 'INSERT'", "SAVEPOINT s1", "SHOW x"])
def test_reads_from_another_alias_go_through(sql: str) -> None:
    sent: list[str] = []
    OtherAliasGuard("other", "default")(lambda s, *a: sent.append(s), sql, None, False, {})
    assert sent == [sql]


@pytest.mark.parametrize(("options", "option"), [
    ({"lease_s": 0}, "lease_s"),
    ({"lease_s": -1.0}, "lease_s"),
    ({"max_slots": 5}, "max_slots"),  # more than POOL_SIZE (4)
    ({"max_slots": 0}, "max_slots"),
    ({"scan_every_s": 0}, "scan_every_s"),
    ({"acquire_timeout_s": -1}, "acquire_timeout_s"),
    ({"settle_parallelism": 0}, "settle_parallelism"),
    ({"lock_timeout_s": 0}, "lock_timeout_s"),
    ({"kafka_timeout_s": -5}, "kafka_timeout_s"),
    ({"settle_attempts": 0}, "settle_attempts"),
    ({"on_step": "not callable"}, "on_step"),
    ({"pipelined": 1}, "pipelined"),
    ({"max_in_flight": 0}, "max_in_flight"),
    ({"slow_commit_s": -1.0}, "slow_commit_s"),
])
def test_each_bad_pool_option_is_reported_by_the_system_check_under_its_own_id(
    settings: Any, options: dict[str, Any], option: str
) -> None:
    settings.KAFKA2PC = {**GOOD, "POOL_OPTIONS": options}
    (error,) = check_settings()
    assert isinstance(error, Error) and error.id == OPTION_CHECK_IDS[option] and option in error.msg
    with pytest.raises(ConfigurationError, match=option):
        read_settings(settings.KAFKA2PC)


def test_several_bad_pool_options_are_each_reported(settings: Any) -> None:
    settings.KAFKA2PC = {**GOOD, "POOL_OPTIONS": {"lease_s": 0, "max_slots": 9, "kafka_timeout_s": 0}}
    ids = sorted(e.id for e in check_settings())
    assert ids == sorted(OPTION_CHECK_IDS[o] for o in ("lease_s", "max_slots", "kafka_timeout_s"))
    assert len(set(OPTION_CHECK_IDS.values())) == len(OPTION_CHECK_IDS)  # one id per option


def test_the_pool_options_are_derived_from_the_recipe_and_build_its_writer_options() -> None:
    from kafka2pc.recipes.django._settings import POOL_OPTIONS
    from kafka2pc.recipes.dual_write import WriterOptions

    assert {"retain_records", "lock_timeout_s", "kafka_timeout_s", "settle_attempts", "lease_s", "max_slots",
            "owner"} <= POOL_OPTIONS
    assert {"pipelined", "max_in_flight", "slow_commit_s"} <= POOL_OPTIONS
    s = read_settings({**GOOD, "POOL_OPTIONS": {"lease_s": 5.0, "retain_records": True}})
    assert s.writer_options() == WriterOptions(retain_records=True, kafka_timeout_s=30.0)
    assert s.pool_keywords() == {"lease_s": 5.0}
    s = read_settings({**GOOD, "POOL_OPTIONS": {"pipelined": True, "max_in_flight": 2, "slow_commit_s": 0.5}})
    assert s.pool_keywords() == {"pipelined": True, "max_in_flight": 2, "slow_commit_s": 0.5}


def test_the_check_ids_of_the_options_do_not_move() -> None:
    """A project may silence an id: the pipelined commit's options are numbered after the others."""
    first = ["acquire_timeout_s", "kafka_timeout_s", "lease_s", "lock_timeout_s", "max_slots", "on_step", "owner",
             "queue_full_timeout_s", "retain_records", "scan_every_s", "settle_attempts", "settle_parallelism", "size"]
    assert [OPTION_CHECK_IDS[name] for name in first] == [f"kafka2pc.E{100 + i}" for i in range(len(first))]
    assert {OPTION_CHECK_IDS[n] for n in ("max_in_flight", "pipelined", "slow_commit_s")} == {
        "kafka2pc.E113", "kafka2pc.E114", "kafka2pc.E115"}


def test_an_unsupported_database_backend_is_reported(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import django.db
    from django.db.utils import ConnectionHandler

    settings.KAFKA2PC = GOOD
    handler = ConnectionHandler({
        "default": {"ENGINE": "django.db.backends.dummy"},
        "archive": {"ENGINE": "django.db.backends.dummy"},
        "replica": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
    })
    monkeypatch.setattr(django.db, "connections", handler)
    found = {(type(m).__name__, m.id) for m in check_settings()}
    assert found == {("Error", "kafka2pc.E002"), ("Warning", "kafka2pc.W002")}
