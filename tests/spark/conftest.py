"""The Spark sink tests share one local SparkSession: the ``spark`` fixture of tests/conftest.py.

Spark is heavy on a small machine, so every in-process test shares one
session (``local[2,4]``: two cores, up to four attempts per task, so task
retries happen), with two shuffle partitions.  No test needs Spark's Kafka
connector: inputs are built in Spark or read from files, outputs are checked
with confluent-kafka.

**Classic and Spark Connect.**  The behaviour tests of the data source and of
the ``foreachBatch`` sink (:data:`CONNECT_MODULES`) run twice, through the
``spark_mode`` parameter: ``classic`` (the shared session itself) and
``connect`` (a Spark Connect client of the same driver, which serves Connect
on its own port: one JVM for both).  The connect cases need PySpark 4 (they are
deselected before).  A
test that only a classic session can run says so with
``@pytest.mark.spark_modes("classic")``.  When the foreachBatch sink's suite
runs elsewhere (``$KAFKA2PC_FOREACHBATCH_ELSEWHERE``: CI runs it on PySpark
3.5), this run keeps only the sink's connect cases.

In one process a Connect client and a classic session disagree on one global:
PySpark takes ``$SPARK_CONNECT_MODE_ENABLED`` to mean "this process is a
Connect client" (``pyspark.sql.functions`` then builds Connect columns).  The
``spark`` fixture sets it for a connect case and clears it for a classic one.

``format("kafka2pc")`` needs PySpark 4's Python data sources.  On an older
line its test modules are left out only when the run says it targets that
line (``KAFKA2PC_SPARK_LINES`` names it, as ``.ci/run``'s PySpark 3.5 step and
``scripts/test-spark.sh`` do); anywhere else their collection fails, with
the import error that names PySpark 4, instead of passing without them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pyspark
import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DATA_SOURCE_MODULES = ["test_spark_datasource*.py"]
CONNECT_MODULES = ("test_spark_datasource", "test_spark_sink")
"""The modules whose tests run on a classic and a Spark Connect session (the crash tests start their own)."""
FOREACHBATCH_SINK_MODULE = "test_spark_sink"

_LINE = ".".join(pyspark.__version__.split(".")[:2])
PYSPARK4 = int(_LINE.split(".")[0]) >= 4
_CONNECT_ENV = "SPARK_CONNECT_MODE_ENABLED"

if not PYSPARK4 and _LINE in os.environ.get("KAFKA2PC_SPARK_LINES", "").split():
    collect_ignore_glob = DATA_SOURCE_MODULES


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spark_modes(*modes): the spark_mode cases a test runs (classic, connect)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test of :data:`CONNECT_MODULES` that uses ``spark`` runs once per session mode."""
    if "spark" not in metafunc.fixturenames or metafunc.module.__name__ not in CONNECT_MODULES:
        return
    marker = metafunc.definition.get_closest_marker("spark_modes")
    metafunc.parametrize("spark_mode", list(marker.args) if marker is not None else ["classic", "connect"])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the connect cases before PySpark 4; with ``$KAFKA2PC_FOREACHBATCH_ELSEWHERE`` (scripts/test.sh in
    CI), keep only the sink's connect cases."""
    elsewhere = bool(os.environ.get("KAFKA2PC_FOREACHBATCH_ELSEWHERE")) and PYSPARK4
    keep, drop = [], []
    for item in items:
        module = getattr(item, "module", None)
        in_sink = module is not None and module.__name__ == FOREACHBATCH_SINK_MODULE
        mode = getattr(item, "callspec", None) and item.callspec.params.get("spark_mode")  # type: ignore[attr-defined]
        gone = (mode == "connect" and not PYSPARK4) or (elsewhere and in_sink and mode != "connect")
        (drop if gone else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def spark_mode() -> str:
    """``classic`` unless the test is parametrised (:func:`pytest_generate_tests`)."""
    return "classic"


@pytest.fixture(scope="session")
def spark_connect(spark: SparkSession) -> Iterator[SparkSession]:
    """A Spark Connect client of the shared session's driver (PySpark 4)."""
    from harness.ports import spark_connect_port
    from pyspark.sql import SparkSession as Builder

    had = os.environ.get(_CONNECT_ENV)
    session = Builder.builder.remote(f"sc://127.0.0.1:{spark_connect_port()}").create()
    if had is None:
        os.environ.pop(_CONNECT_ENV, None)  # set by create(); the spark fixture sets it per test
    yield session
    session.stop()


@pytest.fixture
def spark(spark: SparkSession, spark_mode: str, request: pytest.FixtureRequest,
          monkeypatch: pytest.MonkeyPatch) -> SparkSession:
    """The shared session (``classic``) or a Spark Connect client of it (``connect``)."""
    if spark_mode == "classic":
        monkeypatch.delenv(_CONNECT_ENV, raising=False)
        return spark
    session: SparkSession = request.getfixturevalue("spark_connect")
    monkeypatch.setenv(_CONNECT_ENV, "1")
    return session
