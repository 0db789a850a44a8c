#!/usr/bin/env bash
# The Spark sink's tests on every supported PySpark line (CI calls this after scripts/test.sh):
#   - the newest: the main .venv (scripts/setup.sh with KAFKA2PC_EXTRAS containing "spark"
#     installs the newest PySpark the [spark] extra allows);
#   - 3.5: a second virtualenv, .venv-spark3.5 (scripts/spark-venv.sh 3.5).
# Lines to run: $KAFKA2PC_SPARK_LINES (default "newest 3.5"). Arguments replace the default
# pytest arguments (tests/spark), e.g. scripts/test-spark.sh tests/spark/test_spark_sink_crash.py -x.  Needs Java 17 and the local broker's jars, as the
# main suite does.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
for line in ${KAFKA2PC_SPARK_LINES:-newest 3.5}; do
  if [ "$line" = newest ]; then
    py=.venv/bin/python
  else
    scripts/spark-venv.sh "$line"
    py=".venv-spark$line/bin/python"
  fi
  version=$("$py" -c 'import pyspark; print(pyspark.__version__)')
  start=$(date +%s)
  echo "test-spark: pyspark $version ($py)" >&2
  if [ "$#" -gt 0 ]; then args=("$@"); else args=(tests/spark); fi
  "$py" -m pytest -q -p no:cacheprovider --durations=10 "${args[@]}" || status=$?  # the slowest: the budget in view
  echo "test-spark: pyspark $version finished in $(( $(date +%s) - start ))s (status so far $status)" >&2
done
exit "$status"
