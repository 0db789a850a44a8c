"""``kafka2pc --help`` starts fast: no Kafka client, SQLAlchemy or Spark is imported for it.

Not a timing test (timings are measured in benchmarks, not asserted): it checks
the cause of a slow start instead, in a fresh interpreter, since this pytest
process has long imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

HEAVY = ("confluent_kafka", "kafka", "sqlalchemy", "pyspark", "psycopg")

_PROBE = """
import json, sys
from click.testing import CliRunner
import kafka2pc.cli
runner = CliRunner()
codes = [runner.invoke(kafka2pc.cli.cli, args).exit_code for args in ARGS]
helps = runner.invoke(kafka2pc.cli.cli, ["--help"]).output
print(json.dumps({"codes": codes, "help": helps,
                  "heavy": sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)}))
"""


def test_help_imports_no_heavy_module() -> None:
    args = [["--help"], ["list", "--help"], ["describe", "--help"], ["complete", "--help"],
            ["force-terminate", "--help"], ["in-doubt", "--help"], ["recover", "--help"], ["stats", "--help"],
            ["pending-offsets", "--help"], ["find-hanging", "--help"], ["--version"]]
    code = _PROBE.replace("ARGS", repr(args)).replace("HEAVY", repr(HEAVY))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["codes"] == [0] * len(args)
    for command in ("list", "describe", "complete", "force-terminate", "in-doubt", "recover", "stats",
                    "pending-offsets"):
        assert command in result["help"]
    assert result["heavy"] == [], f"--help imported {result['heavy']}"


def test_public_api_still_imports_lazily() -> None:
    """``kafka2pc/__init__.py`` defers its heavy modules (PEP 562) without changing the API."""
    code = (
        "import sys, kafka2pc\n"
        "before = 'confluent_kafka' in sys.modules or 'kafka' in sys.modules\n"
        "from kafka2pc import TwoPhaseCommitProducer, TransactionAdmin, Decision\n"
        "missing = [n for n in kafka2pc.__all__ if not hasattr(kafka2pc, n)]\n"
        "wrong = [n for n in kafka2pc.__all__ if n != '__version__' and "
        "getattr(getattr(kafka2pc, n), '__module__', 'kafka2pc') != 'kafka2pc']\n"
        "print(before, 'confluent_kafka' in sys.modules, missing, wrong, "
        "set(kafka2pc.__all__) <= set(dir(kafka2pc)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True", "[]", "[]", "True"]


def test_console_script_help_and_version(run_kafka2pc: Callable[..., Any]) -> None:
    run = run_kafka2pc("--help")
    assert run.returncode == 0, run
    assert "Exit codes" in run.stdout
    version = run_kafka2pc("--version")
    assert version.returncode == 0 and "kafka2pc" in version.stdout, version
