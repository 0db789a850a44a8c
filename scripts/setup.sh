#!/usr/bin/env bash
# Install everything kafka2pc needs on a fresh Debian machine, idempotently:
# Java 17 and Maven (to fetch and run Apache Kafka), then a virtualenv in .venv
# with kafka2pc installed editable plus what $KAFKA2PC_EXTRAS names (comma-separated,
# e.g. "test,spark"; empty: the core only): extras of the package (sql, postgres, mysql,
# cli, spark, aio, otel) and pyproject.toml's dependency groups, which are not published
# (test, docs, dev), each with the extras it needs (GROUP_EXTRAS below).
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
# The extras each dependency group's tests or tools import.
declare -A GROUP_EXTRAS=(
  [test]="sql,postgres,mysql,cli,otel,aio,django"
  [docs]="cli"
  [dev]="sql,postgres,mysql,cli,otel,aio,spark,spark-connect,django"
)
wanted=${KAFKA2PC_EXTRAS:-}
extras=()
groups=()
IFS=, read -r -a names <<<"$wanted"
for name in "${names[@]}"; do
  [ -n "$name" ] || continue
  if [ -n "${GROUP_EXTRAS[$name]+set}" ]; then
    groups+=(--group "$name")
    IFS=, read -r -a needed <<<"${GROUP_EXTRAS[$name]}"
    extras+=("${needed[@]}")
  else
    extras+=("$name")
  fi
done
extras_list=$(printf '%s\n' "${extras[@]}" | sed '/^$/d' | sort -u | paste -sd, -)
stamp=".venv/.kafka2pc-installed-$(cat pyproject.toml "$0" | sha1sum | cut -c1-12)-${wanted//,/_}"
if [ ! -f "$stamp" ]; then
  echo "setup: pip install -e .${extras_list:+[$extras_list]} ${groups[*]}" >&2
  .venv/bin/python -m pip install -q --upgrade pip uv >/dev/null
  # uv resolves, downloads and installs in parallel (a fresh machine's install in a fraction of pip's
  # time), and compiles the byte code as pip does; pip (>= 25.1: --group) installs the same when uv cannot.
  .venv/bin/python -m uv pip install -q --python .venv/bin/python --compile-bytecode \
      -e ".${extras_list:+[$extras_list]}" "${groups[@]}" \
    || .venv/bin/python -m pip install -q -e ".${extras_list:+[$extras_list]}" "${groups[@]}"
  touch "$stamp"
fi
# Byte-compile the checkout's packages now, as installing a wheel does: an editable install
# compiles each module on its first import instead, and a thread compiling a large module holds
# the GIL for tens of milliseconds, which the asyncio loop-stall tests measure as a stalled loop.
.venv/bin/python -m compileall -q kafka2pc recipes cli >/dev/null
