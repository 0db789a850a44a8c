#!/usr/bin/env bash
# Install (Debian) and start a local PostgreSQL that matches kafka2pc.testing.postgres'
# default URL: postgresql://postgres:postgres@127.0.0.1:5432/postgres
# The URL is the only thing written to stdout (callers capture it); all other
# output goes to stderr.  The server must not inherit the caller's stdout pipe,
# or a "$(start-postgres.sh)" would wait for the server to exit.
set -euo pipefail
start() {
  local SUDO="" ASPG="runuser -u postgres --"
  [ "$(id -u)" = 0 ] || { SUDO="sudo"; ASPG="sudo -u postgres"; }
  if ! command -v pg_ctlcluster >/dev/null 2>&1 || ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null
  fi
  local ver
  ver=$(ls /usr/lib/postgresql | sort -V | tail -n1)
  if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -q "^$ver main$"; then
    $SUDO pg_createcluster "$ver" main >/dev/null
    # The crash tests' parallel children and the pool tests open many connections at once, and
    # concurrent test sessions share the server: Debian's 100 can run out ("too many clients already").
    $SUDO pg_conftool "$ver" main set max_connections 300
  fi
  # A server killed uncleanly leaves pid/lock files; pg_ctl clears them, but
  # only once the dead postmaster is reaped, so retry a few times.
  local try
  for try in 1 2 3 4 5; do
    pg_lsclusters -h | grep -q "^$ver *main .*online" && break
    $SUDO pg_ctlcluster "$ver" main start && break
    [ "$try" = 5 ] && { echo "start-postgres.sh: PostgreSQL $ver did not start" >&2; return 1; }
    sleep 2
  done
  for _ in $(seq 1 30); do
    $ASPG psql -qAt -c "select 1" >/dev/null 2>&1 && break || sleep 1
  done
  $ASPG psql -q -c "ALTER USER postgres PASSWORD 'postgres'" >/dev/null
}
start >&2
echo "postgresql+psycopg://postgres:postgres@127.0.0.1:5432/postgres"
