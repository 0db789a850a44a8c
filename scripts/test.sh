#!/usr/bin/env bash
# The test suite, on a fresh machine: installs what it needs (Java, Maven,
# PostgreSQL, MariaDB, a virtualenv), then runs pytest against a real Kafka broker
# (fetched from Maven Central and started by the fixtures), real PostgreSQL
# and SQLite. Extra arguments go to pytest.
#
# Without arguments (the full suite, as CI runs it) the crash tests then run
# once more on every other broker line of CI's matrix
# (kafka2pc.testing._settings.CI_KAFKA_VERSIONS): the core crash tests already
# cover every line through the any_kafka_bootstrap fixture, the recipe crash
# tests (tests/recipes/test_*crash*.py) run again with $KAFKA_VERSION set, on
# PostgreSQL (what differs between broker lines is the broker; the SQLite and
# MariaDB variants of the same crash tests already ran on the default line).
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
set +e
.venv/bin/python -m pytest --durations=25 "$@"  # the slowest tests, to keep CI's time in view
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "test.sh: pytest collected no tests: that is a failure" >&2
  exit 1
fi
if [ "$#" = 0 ]; then
  lines=$(.venv/bin/python -c 'from kafka2pc.testing._settings import CI_KAFKA_VERSIONS as v; print(*v[1:])')
  for version in $lines; do
    echo "test.sh: recipe crash tests on Kafka $version" >&2
    set +e
    KAFKA_VERSION=$version .venv/bin/python -m pytest -q -k "not mariadb and not sqlite" tests/recipes/test_*crash*.py
    line_rc=$?
    set -e
    [ "$line_rc" = 0 ] || rc=$line_rc
  done
fi
exit "$rc"
