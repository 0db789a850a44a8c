#!/usr/bin/env bash
# The README demo on a fresh machine: installs what it needs (Java, Maven, a
# virtualenv with kafka2pc), starts a local Kafka broker (downloaded from Maven
# Central on first use), and runs examples/order_service.py: an order service
# killed with SIGKILL between its database commit and its Kafka commit,
# restarted, recovered, and checked (exit code 0 iff consistent).
# Extra arguments go to the demo (e.g. --orders 20 --crash-at 7, --keep-broker).
# The installer's output goes to a log that is shown only if it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp "${TMPDIR:-/tmp}/kafka2pc-setup-XXXXXX.log")
echo "== Setup: Java 17, Maven and a virtualenv with kafka2pc in .venv (the first run takes a few minutes)"
if ! KAFKA2PC_EXTRAS=sql bash scripts/setup.sh >"$log" 2>&1; then
  cat "$log" >&2
  echo "setup failed (log: $log)" >&2
  exit 1
fi
rm -f "$log"
exec .venv/bin/python examples/order_service.py "$@"
