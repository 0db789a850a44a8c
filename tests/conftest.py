"""Test configuration: real Kafka, PostgreSQL and SQLite through kafka2pc.testing."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from harness.seeds import SEED_ENV, replay_hint, run_seed, seed_for

from kafka2pc.testing.broker import BrokerError, LocalKafka

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytest_plugins = ["kafka2pc.testing.pytest_plugin"]

# Every JVM the tests start besides the brokers (Spark's launcher, driver, executors, standalone daemons)
# stops its JIT at C1 and collects with the serial collector: they run tiny jobs and start often, and
# measured on a 2-core machine the Spark tests take 25 % less CPU (150 s instead of 199 s for the data
# source's batch tests). The brokers get the same from kafka2pc.testing._settings.BROKER_JAVA_OPTIONS.
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")

LEGACY_KAFKA_VERSION = os.environ.get("KAFKA_LEGACY_VERSION", "3.9.2")
PREVIOUS_KAFKA_VERSION = os.environ.get("KAFKA_PREVIOUS_VERSION", "4.3.1")


def pytest_configure(config: pytest.Config) -> None:
    """Draw the run's seed before pytest-xdist starts its workers: they inherit it through the environment.

    A run started in the background of a non-interactive shell (``cmd &``) inherits SIGINT ignored, and so
    would every process a test starts: the CLI's ``--watch`` commands, which a test stops with SIGINT (the
    operator's Ctrl-C), would not stop. The run takes SIGINT back; its children start with the default.
    """
    run_seed()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_report_header(config: pytest.Config) -> str:
    return f"{SEED_ENV}={run_seed()} (randomized tests draw from it; set it to replay a run)"


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """This test's seed, derived from ``$KAFKA2PC_SEED`` and its node id (harness.seeds); printed, and named
    in the report when the test fails."""
    hint = replay_hint(request.node.nodeid)
    print(f"\n{hint}")
    request.node.user_properties.append((SEED_ENV, hint))
    return seed_for(request.node.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report: pytest.TestReport = yield
    if report.failed:
        for name, value in item.user_properties:
            if name == SEED_ENV:
                report.sections.append(("seed", str(value)))
    return report


@pytest.fixture(scope="session")
def legacy_kafka() -> Iterator[LocalKafka]:
    """A broker of the older 3.9.x line (no 2PC support), started on demand."""
    try:
        kafka = LocalKafka.up(version=LEGACY_KAFKA_VERSION)
    except BrokerError as exc:
        pytest.fail(f"could not start Kafka {LEGACY_KAFKA_VERSION}: {exc}", pytrace=False)
    yield kafka
    kafka.stop()


@pytest.fixture(scope="session")
def previous_kafka() -> Iterator[LocalKafka]:
    """A broker of the previous 4.x release line, started on demand."""
    try:
        kafka = LocalKafka.up(version=PREVIOUS_KAFKA_VERSION)
    except BrokerError as exc:
        pytest.fail(f"could not start Kafka {PREVIOUS_KAFKA_VERSION}: {exc}", pytrace=False)
    yield kafka
    kafka.stop()


@pytest.fixture(params=["current", "previous", "legacy"])
def any_kafka_bootstrap(request: pytest.FixtureRequest) -> str:
    """Runs a test against every broker line in CI: the default (4.4), the previous 4.x (4.3) and 3.9."""
    if request.param == "current":
        return str(request.getfixturevalue("kafka_bootstrap"))
    if request.param == "previous":
        return request.getfixturevalue("previous_kafka").bootstrap_servers
    return request.getfixturevalue("legacy_kafka").bootstrap_servers


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One local SparkSession for every in-process Spark test (tests/spark, tests/otel).

    ``local[2,4]``: two cores, up to four attempts per task (so task retries
    happen), two shuffle partitions.  No test needs Spark's Kafka connector:
    the sink writes with confluent-kafka.  On PySpark 4 the same driver also
    serves Spark Connect on :func:`harness.ports.spark_connect_port` (the
    ``spark_mode`` "connect" of tests/spark/conftest.py): one JVM for both modes.
    """
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import pyspark
    from harness.ports import spark_connect_port
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master("local[2,4]")
        .appName("kafka2pc-spark-tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.sql.streaming.minBatchesToRetain", "20")
    )
    if int(pyspark.__version__.split(".")[0]) >= 4:  # the spark-connect jar ships in the wheel from 4.0
        builder = (
            builder.config("spark.plugins", "org.apache.spark.sql.connect.SparkConnectPlugin")
            .config("spark.connect.grpc.binding.address", "127.0.0.1")
            .config("spark.connect.grpc.binding.port", str(spark_connect_port()))
        )
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


#: The order pytest-xdist's workers take the test directories in (scripts/test.sh): the longest modules first,
#: the unit tests last, so that no long module is picked up last while the other worker has nothing left to do.
XDIST_ORDER = ("tests/spark/", "tests/testing/", "tests/recipes/", "tests/logs/", "tests/unit/")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (with ``--no-loadscope-reorder``), hand out the long modules first."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        def rank(item: pytest.Item) -> int:
            for n, prefix in enumerate(XDIST_ORDER):
                if item.nodeid.startswith(prefix):
                    return n if prefix != "tests/unit/" else len(XDIST_ORDER)
            return len(XDIST_ORDER) - 1

        items.sort(key=rank)
