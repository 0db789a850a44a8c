"""How the test suite starts Python children that import the harness (zygotes, pool workers, scripts)."""

from __future__ import annotations

import os
from pathlib import Path

#: ``tests/``: on a child's ``sys.path`` so that it imports ``harness`` as the tests do.
TESTS = Path(__file__).resolve().parents[1]
#: The checkout, for children that import ``examples`` or run from its root.
REPO = TESTS.parent


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment, with ``tests/`` and the checkout first on ``PYTHONPATH``."""
    path = os.pathsep.join(p for p in (str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
