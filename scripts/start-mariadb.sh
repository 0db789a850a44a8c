#!/usr/bin/env bash
# Install (Debian) and start a local MariaDB for the dual-write recipe's MySQL/MariaDB tests.
# The URL is the only thing written to stdout (callers capture it); all other output goes to
# stderr.  The server is detached from the caller's stdout pipe, so "$(start-mariadb.sh)"
# returns once it answers.  The user kafka2pc/kafka2pc may create databases (each test
# session makes its own); the tests take the URL from $KAFKA2PC_MARIADB_URL.
set -euo pipefail
start() {
  local SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  if ! command -v mariadbd >/dev/null 2>&1 && ! [ -x /usr/sbin/mariadbd ]; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mariadb-server >/dev/null
  fi
  if ! $SUDO mariadb -uroot -e "select 1" >/dev/null 2>&1; then
    if [ ! -d /var/lib/mysql/mysql ]; then
      $SUDO mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
    fi
    $SUDO mkdir -p /run/mysqld
    $SUDO chown mysql:mysql /run/mysqld
    # Not through the service manager (containers often forbid it); detached from our pipes.
    $SUDO setsid /usr/sbin/mariadbd --user=mysql --datadir=/var/lib/mysql --bind-address=127.0.0.1 \
      --port=3306 --socket=/run/mysqld/mysqld.sock </dev/null >/var/tmp/kafka2pc-mariadb.log 2>&1 &
    local ok=""
    for _ in $(seq 1 60); do
      if $SUDO mariadb -uroot -e "select 1" >/dev/null 2>&1; then ok=1; break; fi
      sleep 1
    done
    [ -n "$ok" ] || { echo "start-mariadb.sh: MariaDB did not start (see /var/tmp/kafka2pc-mariadb.log)" >&2; return 1; }
  fi
  $SUDO mariadb -uroot -e "
    CREATE USER IF NOT EXISTS 'kafka2pc'@'127.0.0.1' IDENTIFIED BY 'kafka2pc';
    CREATE USER IF NOT EXISTS 'kafka2pc'@'localhost' IDENTIFIED BY 'kafka2pc';
    GRANT ALL PRIVILEGES ON *.* TO 'kafka2pc'@'127.0.0.1';
    GRANT ALL PRIVILEGES ON *.* TO 'kafka2pc'@'localhost';
    CREATE DATABASE IF NOT EXISTS kafka2pc;"
}
start >&2
echo "mysql+pymysql://kafka2pc:kafka2pc@127.0.0.1:3306/kafka2pc"
