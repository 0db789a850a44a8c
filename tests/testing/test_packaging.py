"""The installed distribution: recipes and CLI live under kafka2pc, and it is typed."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata, resources


def _run(code: str) -> subprocess.CompletedProcess[str]:
    # Run outside the repository so only the installed distribution is importable.
    return subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=60)


def test_recipes_and_cli_are_not_top_level_packages() -> None:
    for name in ("recipes", "cli"):
        proc = _run(f"import {name}")
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, (name, proc.stderr)


def test_recipes_and_cli_import_under_kafka2pc() -> None:
    proc = _run("import kafka2pc.recipes, kafka2pc.cli, kafka2pc.testing.broker; print('ok')")
    assert proc.stdout.strip() == "ok", proc.stderr


def test_console_script_and_py_typed() -> None:
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("kafka2pc") == "kafka2pc.cli:main"
    assert resources.files("kafka2pc").joinpath("py.typed").is_file()
