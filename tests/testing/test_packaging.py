"""The distribution: what a wheel ships, and what a clean install without extras can do.

The clean-install test builds the sdist and the wheel with ``python -m build``,
installs the wheel into a fresh virtualenv with no extras, and runs a real 2PC
transaction there (prepare + commit against the broker), with SQLAlchemy,
psycopg and click absent.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from collections.abc import Callable
from email.parser import Parser
from importlib import metadata, resources
from pathlib import Path

import pytest

from kafka2pc.testing import drain

ROOT = Path(__file__).resolve().parents[2]


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
    assert scripts.get("kafka2pc") == "kafka2pc.__main__:main"
    assert resources.files("kafka2pc").joinpath("py.typed").is_file()


def test_core_requirements_are_lean() -> None:
    required = [r for r in metadata.requires("kafka2pc") or [] if "extra ==" not in r]
    names = sorted(r.split(">")[0].split("<")[0].split("=")[0].strip().lower() for r in required)
    assert names == ["confluent-kafka", "kafka-python"]
    extras = set(metadata.metadata("kafka2pc").get_all("Provides-Extra") or [])
    # What working on kafka2pc needs (pytest, mkdocs, mypy...) is in dependency groups, not published extras.
    assert extras == {"sql", "postgres", "mysql", "cli", "spark", "spark-connect", "otel", "aio", "django"}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist, and the wheel built from that sdist (``python -m build``: the sdist is complete)."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_wheel_and_sdist_ship_the_license_and_metadata(dist: Path) -> None:
    (wheel,) = dist.glob("kafka2pc-*.whl")
    (sdist,) = dist.glob("kafka2pc-*.tar.gz")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(meta_name).decode())
        license_files = [n for n in names if n.endswith("/licenses/LICENSE")]
        assert license_files, names
        assert "Apache License" in zf.read(license_files[0]).decode()
    assert meta["License-Expression"] == "Apache-2.0"
    assert "Programming Language :: Python :: 3.13" in meta.get_all("Classifier")
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Documentation", "Source", "Issues", "Changelog"} <= set(urls)
    assert meta["Author"] or meta["Author-email"]
    # README links must work on PyPI: no relative targets.
    description = meta.get_payload()
    assert "](docs/" not in description and "](benchmarks/" not in description
    with tarfile.open(sdist) as tf:
        assert any(n.endswith("/LICENSE") for n in tf.getnames())


CHILD = textwrap.dedent(
    """
    import importlib.util, json, subprocess, sys
    bootstrap, topic = sys.argv[1:3]
    absent = {m: importlib.util.find_spec(m) is None for m in ("sqlalchemy", "psycopg", "click")}

    from kafka2pc import TwoPhaseCommitProducer
    p = TwoPhaseCommitProducer({"bootstrap.servers": bootstrap, "transactional.id": "lean-" + topic})
    p.init_transactions()
    p.begin_transaction()
    for i in range(3):
        p.produce(topic, value=b"lean-%d" % i)
    state = p.prepare_transaction()
    p.commit_transaction()
    p.close()

    try:
        import kafka2pc.recipes.dual_write
        recipe_error = None
    except ImportError as exc:
        recipe_error = f"{type(exc).__name__}: {exc}"
    cli = subprocess.run([sys.argv[3], "--help"], capture_output=True, text=True)
    print(json.dumps({"absent": absent, "state": str(state), "recipe_error": recipe_error,
                      "cli": [cli.returncode, cli.stderr]}))
    """
)


def test_a_clean_install_without_extras_runs_a_transaction(
    dist: Path, tmp_path: Path, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    (wheel,) = dist.glob("kafka2pc-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)],
        capture_output=True, text=True, timeout=600,
    )
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    topic = topic_factory()
    child = subprocess.run(
        [str(venv / "bin" / "python"), "-c", CHILD, kafka_bootstrap, topic, str(venv / "bin" / "kafka2pc")],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["absent"] == {"sqlalchemy": True, "psycopg": True, "click": True}
    assert report["state"].startswith("k2pc1:")
    assert sorted(r.value for r in drain(kafka_bootstrap, topic, "read_committed")) == [b"lean-0", b"lean-1", b"lean-2"]
    # What needs an extra says which one.
    assert report["recipe_error"].startswith("MissingExtraError:")
    assert "pip install 'kafka2pc[sql]'" in report["recipe_error"]
    returncode, stderr = report["cli"]
    assert returncode == 1
    assert stderr.count("\n") == 1 and "pip install 'kafka2pc[cli]'" in stderr


def test_missing_extra_names_the_extra_only_for_third_party_modules() -> None:
    from kafka2pc._extras import MissingExtraError, missing_extra

    third_party = missing_extra(ModuleNotFoundError("no", name="sqlalchemy.orm"), extra="sql", feature="the recipe")
    assert isinstance(third_party, MissingExtraError) and isinstance(third_party, ImportError)
    assert str(third_party) == (
        "the recipe needs the optional dependency 'sqlalchemy.orm', which is not installed: "
        "pip install 'kafka2pc[sql]'"
    )
    own = ModuleNotFoundError("bug", name="kafka2pc._gone")
    assert missing_extra(own, extra="sql", feature="the recipe") is own
