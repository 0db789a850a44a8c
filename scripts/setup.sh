#!/usr/bin/env bash
# Install everything kafka2pc needs on a fresh Debian machine, idempotently:
# Java 17 and Maven (to fetch and run Apache Kafka), then a virtualenv in .venv
# with kafka2pc installed editable plus the extras named in $KAFKA2PC_EXTRAS
# (comma-separated, e.g. "test,spark"; see pyproject.toml; empty: the core only).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
need=()
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || need+=(maven)
if [ "${#need[@]}" -gt 0 ]; then
  echo "setup: installing ${need[*]} (apt)" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -m venv .venv 2>/dev/null; then
    # Debian's python3 ships venv/ensurepip separately.
    rm -rf .venv
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null
    "$PY" -m venv .venv
  fi
fi
extras=${KAFKA2PC_EXTRAS:-}
stamp=".venv/.kafka2pc-installed-$(cat pyproject.toml | sha1sum | cut -c1-12)-${extras//,/_}"
if [ ! -f "$stamp" ]; then
  echo "setup: pip install -e .${extras:+[$extras]}" >&2
  .venv/bin/python -m pip install -q --upgrade pip uv >/dev/null
  # uv resolves, downloads and installs in parallel (a fresh machine's install in a fraction of pip's
  # time), and compiles the byte code as pip does; pip installs the same when uv cannot.
  .venv/bin/python -m uv pip install -q --python .venv/bin/python --compile-bytecode -e ".${extras:+[$extras]}" \
    || .venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
  touch "$stamp"
fi
# Byte-compile the checkout's packages now, as installing a wheel does: an editable install
# compiles each module on its first import instead, and a thread compiling a large module holds
# the GIL for tens of milliseconds, which the asyncio loop-stall tests measure as a stalled loop.
.venv/bin/python -m compileall -q kafka2pc recipes cli >/dev/null
