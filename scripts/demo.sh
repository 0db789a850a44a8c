#!/usr/bin/env bash
# The README demo on a fresh machine: installs what it needs (Java, Maven, a
# virtualenv with kafka2pc), starts a local Kafka broker (downloaded from Maven
# Central on first use), and runs examples/order_service.py: an order service
# killed with SIGKILL between its database commit and its Kafka commit,
# restarted, recovered, and checked (exit code 0 iff consistent).
# Extra arguments go to the demo (e.g. --orders 20 --crash-at 7).
set -euo pipefail
cd "$(dirname "$0")/.."
KAFKA2PC_EXTRAS=sql bash scripts/setup.sh
exec .venv/bin/python examples/order_service.py "$@"
