"""What the test modules share: ports, private brokers and small helpers (importable as ``harness``).

``tests/`` is on ``sys.path`` while pytest runs (its ``conftest.py`` is not in a
package), so test modules write ``from harness.ports import private_broker``.
"""
