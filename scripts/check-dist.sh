#!/usr/bin/env bash
# Build the sdist and the wheel, check them with twine, install the wheel (with the
# extras its public modules import) into a clean virtualenv and import every public
# module from there.  About a minute on an idle machine, most of it pip.
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
]
for name in modules:
    module = importlib.import_module(name)
    assert module.__file__ and "site-packages" in module.__file__, (name, module.__file__)
    for public in getattr(module, "__all__", []):
        getattr(module, public)
try:
    importlib.import_module("kafka2pc.recipes.spark_sink")
except ImportError as exc:
    assert "kafka2pc[spark]" in str(exc), exc
try:  # without the [django] extra, the Django app names it too
    importlib.import_module("kafka2pc.recipes.django")
except ImportError as exc:
    assert "kafka2pc[django]" in str(exc), exc
print(f"check-dist: kafka2pc {kafka2pc.__version__}: {len(modules)} public modules import from the wheel")
PY
