"""The Spark package's public surface: one import path, no test aids, old paths warn; no test hooks in the library."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import kafka2pc.recipes.spark as package
import pytest
from kafka2pc.recipes.spark import _options

from kafka2pc import UsageError

TEST_AIDS = ("FaultInjection", "TaskHook", "TaskPoint", "TaskStep", "WriterSpec", "write_partition")


def _fresh_import(name: str) -> object:
    sys.modules.pop(name, None)
    with pytest.warns(DeprecationWarning, match=r"import .*from kafka2pc\.recipes\.spark"):
        return importlib.import_module(name)


def test_one_import_path_for_both_spark_paths() -> None:
    for name in ("KafkaTwoPhaseSink", "register_data_source", "recover", "SinkRecovery", "DataSourceMonitor",
                 "LocalDecisionStore", "HadoopDecisionStore", "BatchMetrics", "SinkDecision", "UnknownTopicError"):
        assert name in package.__all__, name
    assert package.recover is _options.recover  # importable without PySpark 4's data sources


def test_spark_step_hook_has_its_own_name() -> None:
    """The dual-write recipe's StepHook takes a Step; the Spark one, (SinkStep, batch id): SinkStepHook."""
    with pytest.warns(DeprecationWarning, match="use SinkStepHook"):
        assert package.StepHook is package.SinkStepHook  # type: ignore[attr-defined]
    assert "StepHook" not in package.__all__


def test_test_aids_are_not_public() -> None:
    for name in TEST_AIDS:
        assert name not in package.__all__, name
        assert not hasattr(package, name), name
    import inspect

    assert "faults" not in inspect.signature(package.KafkaTwoPhaseSink).parameters


def test_old_module_paths_warn_and_export_the_package_names() -> None:
    old_path = _fresh_import("kafka2pc.recipes.spark_sink")
    assert sorted(old_path.__all__) == sorted(package.__all__)  # type: ignore[attr-defined]
    for name in package.__all__:
        assert getattr(old_path, name) is getattr(package, name)


def test_batch_decisions_need_a_path_off_a_local_master() -> None:
    """The default directory is one driver host's disk: used on local[*] only (pure logic, no Spark)."""
    opts = _options.Options.parse({"kafka.bootstrap.servers": "b:9092", "kafka2pc.runId": "r1"})
    sink_id, directory = _options.location(opts, streaming=False, local_master=True)
    assert directory.endswith(f"/.kafka2pc/spark/{sink_id}") and sink_id.startswith("r") and len(sink_id) == 17
    for master in (False, None):
        with pytest.raises(UsageError, match="set the option kafka2pc.decisionPath"):
            _options.location(opts, streaming=False, local_master=master)
    given = _options.Options.parse({"kafka.bootstrap.servers": "b:9092", "kafka2pc.decisionPath": "/mnt/d"})
    assert _options.location(given, streaming=False, local_master=False)[1].startswith("/mnt/d/r")
    assert [m for m in ("local", "local[*]", "local[2,4]", "spark://h:7077", "yarn", "local-cluster[2,1,1024]")
            if _options.is_local_master(m)] == ["local", "local[*]", "local[2,4]"]


def test_library_reads_no_environment_and_kills_no_process() -> None:
    """Fault injection is passed in (task hooks through a private seam, ``on_step=``), never read from the environment."""
    for source in Path(package.__file__).parent.glob("*.py"):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                assert (ast.unparse(node) not in {"os.environ", "os.getenv", "os.kill", "os.killpg"}), (
                    f"{source.name}:{node.lineno}: {ast.unparse(node)}"
                )
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = {a.name for a in node.names} | {getattr(node, "module", None) or ""}
                assert "signal" not in names, f"{source.name}:{node.lineno} imports signal"
