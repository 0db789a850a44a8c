"""kafka-python's private members on a connected client (see tests/unit/test_kafka_python_compat.py)."""

from __future__ import annotations

from kafka2pc._control import ControlPlane
from kafka2pc._control import _kafka_python as compat


def test_connected_client_meets_every_assumption(kafka_bootstrap: str) -> None:
    with ControlPlane({"bootstrap.servers": kafka_bootstrap}, timeout_s=20) as control:
        control.api_versions()  # connects
        assert control.describe_transaction("compat-never-used", timeout=20) is None  # a coordinator connection
        admin = control.session.connected_client()
        assert admin is not None
        problems = compat.check_compatibility(admin)
        assert not problems, (
            f"kafka-python {compat.KAFKA_PYTHON_VERSION} broke {len(problems)} assumption(s):\n  "
            + "\n  ".join(problems)
        )
        assert compat.broker_ids(admin)
        # The count moves by the requests sent: an id never seen needs FindCoordinator and DescribeTransactions.
        before, wire_before = compat.requests_written(admin), control.wire_requests_written()
        assert before >= 2  # ApiVersions' and the first describe's requests were counted
        assert control.describe_transaction("compat-never-used-either", timeout=20) is None
        written = compat.requests_written(admin) - before
        assert written >= 2, f"{written} requests counted for FindCoordinator + DescribeTransactions"
        assert control.wire_requests_written() - wire_before == written
