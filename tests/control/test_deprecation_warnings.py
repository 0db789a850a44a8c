"""kafka2pc stays out of the way of applications that turn DeprecationWarning into errors.

kafka-python 3.0 reads its protocol schemas with a deprecated importlib call at
import time; an application running ``-W error::DeprecationWarning`` (or
pytest's ``filterwarnings = error``) must still be able to use the admin API.
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from kafka2pc import TransactionAdmin, TwoPhaseCommitProducer
with TransactionAdmin({"bootstrap.servers": sys.argv[1]}) as admin:
    listed = admin.list_transactions()
print("listed", len(listed))
"""


def test_list_transactions_under_warnings_as_errors(kafka_bootstrap: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", SCRIPT, kafka_bootstrap],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("listed "), proc.stdout


def test_importing_the_control_plane_emits_no_deprecation_warning() -> None:
    code = "import warnings; warnings.simplefilter('error'); import kafka2pc._control, kafka2pc._errors; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
