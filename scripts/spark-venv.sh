#!/usr/bin/env bash
# A second virtualenv with another PySpark line, for the Spark sink's tests:
#   scripts/spark-venv.sh 3.5            -> .venv-spark3.5 with pyspark[sql] 3.5.x
#   scripts/spark-venv.sh 3.5 && .venv-spark3.5/bin/python -m pytest tests/spark -q
# (scripts/test-spark.sh does both.)  Idempotent; needs scripts/setup.sh's Java.
set -euo pipefail
cd "$(dirname "$0")/.."
line=${1:?usage: scripts/spark-venv.sh <pyspark line, e.g. 3.5>}
venv=".venv-spark$line"
PY=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
stamp="$venv/.kafka2pc-installed-$(cat pyproject.toml "$0" | sha1sum | cut -c1-12)"
extras=sql,postgres,mysql,cli,otel,aio  # what the test group's tests import (scripts/setup.sh's GROUP_EXTRAS[test])
if [ ! -f "$stamp" ]; then
  echo "spark-venv: installing kafka2pc[$extras] + the test group + pyspark[sql]==$line.* into $venv" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip uv >/dev/null
  # PySpark 3.5 pins numpy<2 but not pyarrow or pandas, whose newest releases need numpy 2
  # (pyarrow >= 21: "pyarrow requires NumPy 2.0 or newer"): pin versions of its time.
  extra=()
  [ "$line" = 3.5 ] && extra=("pyarrow>=11,<18" "pandas>=1.5,<2.3")
  # uv installs in parallel (scripts/setup.sh); pip installs the same when uv cannot.
  "$venv/bin/python" -m uv pip install -q --python "$venv/bin/python" -e ".[$extras]" --group test \
      "pyspark[sql]==$line.*" "${extra[@]}" \
    || "$venv/bin/python" -m pip install -q -e ".[$extras]" --group test "pyspark[sql]==$line.*" "${extra[@]}"
  touch "$stamp"
fi
"$venv/bin/python" -c "import pyspark; print('spark-venv:', '$venv', 'pyspark', pyspark.__version__)" >&2
