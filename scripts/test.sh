#!/usr/bin/env bash
# The test suite, on a fresh machine: installs what it needs (Java, Maven,
# PostgreSQL, MariaDB, a virtualenv), then runs pytest against a real Kafka broker
# (fetched from Maven Central and started by the fixtures), real PostgreSQL
# and SQLite. Extra arguments go to pytest (one process).
#
# Without arguments (the full suite, as CI runs it) the dual write's decision
# points then run once more on the oldest broker line of CI's matrix
# (kafka2pc.testing._settings.CI_KAFKA_VERSIONS), with $KAFKA_VERSION set, on
# PostgreSQL: the crash matrix at the steps around the database COMMIT, the
# recovery killed at each of its steps, the heuristic outcome. What differs
# between broker lines is the coordinator, which the core crash tests already
# cover on every line through the any_kafka_bootstrap fixture; the asyncio and
# pool crash tests and the SQLite and MariaDB variants ran on the default line.
#
# Randomized tests draw from one seed per run, $KAFKA2PC_SEED (tests/harness/seeds.py): set it to
# replay a run; without it a new one is drawn here, printed, and shared by every pytest process.
set -euo pipefail
cd "$(dirname "$0")/.."
# The foreachBatch sink's suite (.ci/run runs it on PySpark 3.5 with scripts/test-spark.sh); on PySpark 4 the
# cluster module also runs the format("kafka2pc") data source's path.
FOREACHBATCH_MODULES="tests/spark/test_spark_sink.py tests/spark/test_spark_sink_crash.py
  tests/spark/test_spark_sink_failed_batch.py tests/spark/test_spark_sink_repair.py tests/spark/test_spark_sink_reuse.py
  tests/spark/test_spark_sink_cluster.py tests/spark/test_repair_check.py"
if [ "${1:-}" = --foreachbatch-modules ]; then echo $FOREACHBATCH_MODULES; exit 0; fi  # for .ci/run
KAFKA2PC_EXTRAS=test,spark,spark-connect bash scripts/setup.sh  # the test group (pytest, ...) with sql,postgres,mysql,cli,otel,aio
if [ -z "${KAFKA2PC_PG_ADMIN_URL:-}" ]; then
  KAFKA2PC_PG_ADMIN_URL=$(bash scripts/start-postgres.sh | tail -n1)
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "test.sh: PostgreSQL did not start" >&2; exit 1; }
fi
export KAFKA2PC_PG_ADMIN_URL
if [ -z "${KAFKA2PC_MARIADB_URL:-}" ]; then
  KAFKA2PC_MARIADB_URL=$(bash scripts/start-mariadb.sh | tail -n1)
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "test.sh: MariaDB did not start" >&2; exit 1; }
fi
export KAFKA2PC_MARIADB_URL
if ! command -v redis-server >/dev/null 2>&1; then  # Celery's broker in tests/recipes/pool/test_celery_prefork.py
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  echo "test.sh: installing redis-server (apt)" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
if [ -z "${KAFKA2PC_SEED:-}" ]; then
  KAFKA2PC_SEED=$(( (RANDOM << 15 | RANDOM) ))
fi
export KAFKA2PC_SEED
echo "test.sh: KAFKA2PC_SEED=$KAFKA2PC_SEED (set it to replay this run's randomized tests)"
no_tests() {  # pytest's exit code 5: it collected nothing
  echo "test.sh: pytest collected no tests: that is a failure" >&2
  exit 1
}
other_lines() {  # the dual write's decision points on the oldest broker line (the core crash tests run on every line)
  local rc=0 line_rc version
  for version in $(.venv/bin/python -c 'from kafka2pc.testing._settings import CI_KAFKA_VERSIONS as v; print(v[-1])'); do
    echo "test.sh: the dual write's decision points on Kafka $version"
    KAFKA_VERSION=$version KAFKA2PC_CRASH_POINTS=prepared,state_stored,db_committing,db_committed \
      KAFKA2PC_CRASH_RACE_RUNS=8 .venv/bin/python -m pytest -q -p no:cacheprovider --durations=5 \
      "tests/recipes/sync/test_dual_write_crash.py::test_crash_matrix[postgresql]" \
      "tests/recipes/sync/test_dual_write_crash.py::test_kill_during_recovery_then_recover_again[postgresql]" \
      tests/recipes/sync/test_dual_write_crash.py::test_heuristic_outcome_is_reported_and_retained_records_are_republished_once
    line_rc=$?
    [ "$line_rc" != 5 ] || { echo "test.sh: pytest collected no tests on Kafka $version"; line_rc=1; }
    [ "$line_rc" = 0 ] || rc=$line_rc
  done
  return "$rc"
}
deselect=()
if [ -n "${KAFKA2PC_FOREACHBATCH_ELSEWHERE:-${KAFKA2PC_FOREACHBATCH_CRASH_ELSEWHERE:-}}" ]; then
  # .ci/run runs the foreachBatch sink's whole suite on PySpark 3.5, the line that sink is for; the main
  # run (the newest PySpark) then leaves it out instead of running it twice, and keeps the data source's
  # tests (PySpark 4 only), its cluster test's data-source path among them.
  # test_spark_sink.py stays: tests/spark/conftest.py keeps only its Spark Connect cases (PySpark 4 only).
  for module in $FOREACHBATCH_MODULES; do
    case "$module" in
      tests/spark/test_spark_sink_cluster.py|tests/spark/test_spark_sink.py) ;;
      *) deselect+=(--ignore="$module") ;;
    esac
  done
  deselect+=(--deselect "tests/spark/test_spark_sink_cluster.py::test_speculative_copy_then_executor_killed_while_its_task_holds_a_prepared_transaction[foreachBatch]")
fi
wipe_blocks() {  # every local broker in the port blocks the full suite uses, stopped and its data deleted
  local base=${KAFKA2PC_PORT_BASE:-20000} block
  for block in $(( base + 2000 )) $(.venv/bin/python -c "from kafka2pc.testing.broker import worker_port_base as w
print(*(w($base, n) for n in range(${KAFKA2PC_TEST_WORKERS:-3})))"); do
    KAFKA2PC_PORT_BASE=$block .venv/bin/python -m kafka2pc.testing.broker wipe --all >/dev/null 2>&1 || true
  done
}
set +e
if [ "$#" = 0 ]; then
  # The property-based unit tests draw 0.3 of their examples (a new seed each run; the Python matrix 0.1).
  export KAFKA2PC_PROPERTY_EXAMPLES_SCALE=${KAFKA2PC_PROPERTY_EXAMPLES_SCALE:-0.3}
  # Fresh brokers: a stopped broker keeps its data, and one restarted with the thousands of partitions an
  # earlier run left behind spends minutes loading them before it serves.
  wipe_blocks
  # The full suite in three processes (pytest-xdist, whole modules), each with its own brokers in its own
  # port block, and beside them, in a port block of its own ($KAFKA2PC_PORT_BASE + 2000, between the
  # workers' blocks), the dual write's decision points on the other broker lines. Then, alone on the
  # machine, the tests marked "quiet", which measure how late the event loop runs or how long a call
  # waits against its bound.
  lines_log=$(mktemp)
  KAFKA2PC_PORT_BASE=$(( ${KAFKA2PC_PORT_BASE:-20000} + 2000 )) other_lines >"$lines_log" 2>&1 &
  lines_pid=$!
  .venv/bin/python -m pytest -n "${KAFKA2PC_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder \
    -m "not campaign and not quiet" "${deselect[@]}" \
    --durations=25  # the slowest tests, to keep CI's time in view
  rc=$?
  [ "$rc" != 5 ] || no_tests
  wait "$lines_pid"
  lines_rc=$?
  cat "$lines_log"
  rm -f "$lines_log"
  [ "$lines_rc" = 0 ] || [ "$rc" != 0 ] || rc=$lines_rc
  # Alone means alone: every broker the workers and the other broker lines left running stops, its data
  # deleted (the quiet tests start their own, fresh).
  wipe_blocks
  echo "test.sh: before the quiet tests, the load average is $(cut -d' ' -f1-3 /proc/loadavg); the busiest processes:"
  top -b -c -w 160 -n 2 -d 1 -o %CPU | awk '/^top -/{n++} n == 2' | sed -n '7,12p' || true
  .venv/bin/python -m pytest -m "quiet and not campaign" --durations=5
  quiet_rc=$?
  [ "$quiet_rc" != 5 ] || no_tests
  [ "$quiet_rc" = 0 ] || [ "$rc" != 0 ] || rc=$quiet_rc
else
  .venv/bin/python -m pytest --durations=25 "$@"
  rc=$?
  [ "$rc" != 5 ] || no_tests
fi
set -e
exit "$rc"
