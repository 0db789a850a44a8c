#!/usr/bin/env bash
# Build the sdist and the wheel, check them with twine and their metadata (the version, no
# development extras), install the wheel (with the extras its public modules import) into a
# clean virtualenv and import every public module from there.  About a minute on an idle
# machine, most of it pip.
#   scripts/check-dist.sh [PYTHON]      (default: .venv/bin/python, which has build and twine)
# The clean virtualenv uses pip's cache; nothing is left behind (a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m build --sdist --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 \
  || { cat "$work/build.log"; exit 1; }
"$python" -m twine check --strict "$work"/dist/*
# The published metadata: pyproject.toml's version, and only the extras users install (what working
# on kafka2pc needs is in dependency groups, which are not published).
"$python" - "$work"/dist/kafka2pc-*.whl <<'PY'
import re, sys, zipfile
from email.parser import Parser

(wheel,) = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
version = re.search(r'^version = "([^"]+)"$', open("pyproject.toml").read(), re.M).group(1)
assert meta["Version"] == version, (meta["Version"], version)
extras = set(meta.get_all("Provides-Extra") or [])
assert extras == {"sql", "postgres", "mysql", "cli", "spark", "spark-connect", "otel", "aio", "django"}, sorted(extras)
leaked = [r for r in meta.get_all("Requires-Dist") or [] if re.search(r"pytest|mkdocs|mypy|ruff|nox|twine", r)]
assert not leaked, leaked
print(f"check-dist: metadata of {meta['Name']} {meta['Version']}: extras {', '.join(sorted(extras))}")
PY
"$python" -m venv --without-pip "$work/venv"
wheel=$(ls "$work"/dist/kafka2pc-*.whl)
"$python" -m pip --python "$work/venv/bin/python" install -q --disable-pip-version-check "${wheel}[sql,cli,otel,aio]"
# Outside the repository, so only the installed wheel is importable.  Without the
# [spark] extra, the Spark sink's module must fail with the error naming it.
(cd "$work" && "$work/venv/bin/python" - <<'PY')
import importlib
import kafka2pc

modules = [
    "kafka2pc", "kafka2pc.aio", "kafka2pc.otel", "kafka2pc.testing", "kafka2pc.testing.broker",
    "kafka2pc.recipes", "kafka2pc.recipes.dual_write", "kafka2pc.recipes.dual_write.aio", "kafka2pc.cli",
    "kafka2pc.recipes.spark",  # importable without PySpark: recover() needs none
]
for name in modules:
    module = importlib.import_module(name)
    assert module.__file__ and "site-packages" in module.__file__, (name, module.__file__)
    for public in getattr(module, "__all__", []):
        getattr(module, public)
try:  # without the [spark] extra, format("kafka2pc") fails naming what it needs
    importlib.import_module("kafka2pc.recipes.spark._datasource")
except ImportError as exc:
    assert "kafka2pc[spark]" in str(exc), exc
else:
    raise AssertionError("kafka2pc.recipes.spark._datasource imported without PySpark")
try:  # without the [django] extra, the Django app names it too
    importlib.import_module("kafka2pc.recipes.django")
except ImportError as exc:
    assert "kafka2pc[django]" in str(exc), exc
print(f"check-dist: kafka2pc {kafka2pc.__version__}: {len(modules)} public modules import from the wheel")
PY
