"""The README's demo (``./scripts/demo.sh`` runs ``examples/order_service.py``), against the session's broker.

Killed between "DB committed" and "Kafka committed", restarted: recovery commits exactly the
transaction the database committed, the final check passes, librdkafka writes no raw
``%N|...|FACILITY|`` line to stderr (its logs go through ``logging``), no line of the output is a
warning, and the demo's temporary folder is gone afterwards.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_is_killed_recovers_the_right_transaction_prints_no_warning_and_cleans_up(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap, TMPDIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "order_service.py"), "--orders", "4", "--crash-at", "2"],
        env=env, capture_output=True, text=True, timeout=180, check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "order 2: database COMMITTED, Kafka transaction only PREPARED -> kill -9 now" in output
    assert "order service exited with SIGKILL" in output
    assert re.search(r"recovery: the database committed Kafka state k2pc1:\S+; Kafka's open transaction is "
                     r"exactly that one -> commit; the stored transaction is now committed", output), output
    assert "orders in the database:              4" in output and "OrderPlaced events (read_committed): 4" in output
    assert "CONSISTENT: every order has exactly one event and vice versa" in output
    raw = [line for line in output.splitlines() if re.match(r"%\d+\|", line)]
    assert not raw, f"raw librdkafka lines on the terminal: {raw}"
    warnings = [line for line in output.splitlines() if re.search(r"warn", line, re.IGNORECASE)]
    assert len(warnings) == 0, f"{len(warnings)} warning line(s) in the demo's output: {warnings}"
    assert f"export KAFKA_BOOTSTRAP_SERVERS={kafka_bootstrap}" in output, output  # how to point the examples at it
    assert not list(tmp_path.glob("kafka2pc-demo-*")), "the demo left its temporary folder behind"
