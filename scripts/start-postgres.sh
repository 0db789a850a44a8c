#!/usr/bin/env bash
# Install (Debian) and start a local PostgreSQL that matches kafka2pc.testing.postgres'
# default URL: postgresql://postgres:postgres@127.0.0.1:5432/postgres
set -euo pipefail
SUDO=""; ASPG="runuser -u postgres --"
[ "$(id -u)" = 0 ] || { SUDO="sudo"; ASPG="sudo -u postgres"; }
if ! command -v pg_ctlcluster >/dev/null 2>&1 || ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null
fi
ver=$(ls /usr/lib/postgresql | sort -V | tail -n1)
if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -q "^$ver main$"; then
  $SUDO pg_createcluster "$ver" main >/dev/null
fi
if ! pg_lsclusters -h | grep -q "^$ver *main .*online"; then
  $SUDO pg_ctlcluster "$ver" main start
fi
for _ in $(seq 1 30); do
  $ASPG psql -qAt -c "select 1" >/dev/null 2>&1 && break || sleep 1
done
$ASPG psql -q -c "ALTER USER postgres PASSWORD 'postgres'" >/dev/null
echo "postgresql+psycopg://postgres:postgres@127.0.0.1:5432/postgres"
