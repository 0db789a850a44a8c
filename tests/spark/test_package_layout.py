"""The Spark sink package: the old module path keeps its names; no test hooks hidden in the library."""

from __future__ import annotations

import ast
from pathlib import Path

import kafka2pc.recipes.spark as package
import kafka2pc.recipes.spark_sink as old_path


def test_old_module_path_exports_the_package_names() -> None:
    assert sorted(old_path.__all__) == sorted(package.__all__)
    for name in package.__all__:
        assert getattr(old_path, name) is getattr(package, name)
    for name in ("KafkaTwoPhaseSink", "FaultInjection", "LocalDecisionStore", "HadoopDecisionStore",
                 "SinkDecision", "SinkTransaction", "BatchMetrics", "PartitionResult", "write_partition"):
        assert name in old_path.__all__  # the names it exported before it became a package


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
