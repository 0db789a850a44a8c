#!/usr/bin/env bash
# The test suite, on a fresh machine: installs what it needs (Java, Maven,
# PostgreSQL, a virtualenv), then runs pytest against a real Kafka broker
# (fetched from Maven Central and started by the fixtures), real PostgreSQL
# and SQLite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
KAFKA2PC_EXTRAS=test,spark,otel bash scripts/setup.sh
if [ -z "${KAFKA2PC_PG_ADMIN_URL:-}" ]; then
  KAFKA2PC_PG_ADMIN_URL=$(bash scripts/start-postgres.sh | tail -n1)
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "test.sh: PostgreSQL did not start" >&2; exit 1; }
fi
export KAFKA2PC_PG_ADMIN_URL
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "test.sh: pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
