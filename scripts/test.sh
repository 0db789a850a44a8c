#!/usr/bin/env bash
# The test suite, on a fresh machine: installs what it needs (Java, Maven,
# PostgreSQL, MariaDB, a virtualenv), then runs pytest against a real Kafka broker
# (fetched from Maven Central and started by the fixtures), real PostgreSQL
# and SQLite. Extra arguments go to pytest.
#
# Without arguments (the full suite, as CI runs it) two pytest processes run
# side by side, each with its own brokers in its own port block
# ($KAFKA2PC_PORT_BASE), because most tests wait on brokers, databases and
# timeouts rather than use the CPU:
#   1. everything but the directories in SECOND below, on the default block;
#   2. on the next block: those directories (tests/spark and a few that start
#      their own clusters), then the crash tests once more on every other broker
#      line of CI's matrix (kafka2pc.testing._settings.CI_KAFKA_VERSIONS).
#      The core crash tests already cover every line through the
#      any_kafka_bootstrap fixture; the recipe crash tests
#      (tests/recipes/test_*crash*.py) run again with $KAFKA_VERSION set, on
#      PostgreSQL (what differs between broker lines is the broker; the SQLite
#      and MariaDB variants of the same crash tests ran on the default line).
# The second process's output follows the first's. Then, alone on the machine,
# the tests marked "quiet" (they measure how late the event loop runs, which a
# second CPU-heavy process would distort).
set -euo pipefail
cd "$(dirname "$0")/.."
KAFKA2PC_EXTRAS=test,spark bash scripts/setup.sh  # test = sql,postgres,mysql,cli,otel + pytest
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
if [ "$#" -gt 0 ]; then
  set +e
  .venv/bin/python -m pytest "$@"
  rc=$?
  set -e
  [ "$rc" != 5 ] || { echo "test.sh: pytest collected no tests: that is a failure" >&2; exit 1; }
  exit "$rc"
fi

base=${KAFKA2PC_PORT_BASE:-20000}  # the next block of 2000 ports, or the one before when the next would reach 32768
if (( base + 4000 <= 32768 )); then second=$(( base + 2000 )); else second=$(( base - 2000 )); fi
SECOND=(tests/spark tests/testing tests/logs tests/cli)  # about a third of the suite's time
parallel="not campaign and not quiet"
second_log=$(mktemp)
second_part() {
  local rc=0 line_rc version lines
  export KAFKA2PC_PORT_BASE=$second
  echo "test.sh: ${SECOND[*]} (port block $second)"
  .venv/bin/python -m pytest -p no:cacheprovider --durations=10 -m "$parallel" "${SECOND[@]}" || rc=$?
  [ "$rc" != 5 ] || { echo "test.sh: pytest collected no tests in ${SECOND[*]}: that is a failure"; rc=1; }
  lines=$(.venv/bin/python -c 'from kafka2pc.testing._settings import CI_KAFKA_VERSIONS as v; print(*v[1:])')
  for version in $lines; do
    echo "test.sh: recipe crash tests on Kafka $version (port block $second)"
    line_rc=0
    KAFKA_VERSION=$version .venv/bin/python -m pytest -p no:cacheprovider -q -k "not mariadb and not sqlite" \
      tests/recipes/test_*crash*.py || line_rc=$?
    [ "$line_rc" = 0 ] || rc=$line_rc
  done
  return "$rc"
}
second_part >"$second_log" 2>&1 &
second_pid=$!
trap 'pkill -TERM -P "$second_pid" 2>/dev/null || true; kill "$second_pid" 2>/dev/null || true; rm -f "$second_log"' EXIT
set +e
.venv/bin/python -m pytest --durations=25 -m "$parallel" "${SECOND[@]/#/--ignore=}"  # the slowest: CI's time in view
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "test.sh: pytest collected no tests: that is a failure" >&2
  rc=1
fi
second_rc=0
wait "$second_pid" || second_rc=$?
cat "$second_log"
echo "test.sh: the second part (${SECOND[*]}, crash tests on the other broker lines) exited $second_rc" >&2
[ "$rc" != 0 ] || rc=$second_rc
echo "test.sh: the tests marked quiet, alone" >&2
quiet_rc=0
.venv/bin/python -m pytest -p no:cacheprovider -m "quiet and not campaign" || quiet_rc=$?
[ "$quiet_rc" != 5 ] || { echo "test.sh: no test is marked quiet: that is a failure" >&2; quiet_rc=1; }
[ "$rc" != 0 ] || rc=$quiet_rc
exit "$rc"
