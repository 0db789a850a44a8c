"""Replayable randomness: one seed per run (``$KAFKA2PC_SEED``), one seed per test derived from it.

Every randomized test takes the ``seed`` fixture (``tests/conftest.py``) or :func:`seed_for`, prints
``KAFKA2PC_SEED=<n>`` and, when it fails, names it in the report. Without ``$KAFKA2PC_SEED`` a run draws
a fresh seed (so that the sampled cells rotate from run to run) and stores it in the environment, where
pytest-xdist's workers and every child process find the same one. A test's own seed depends on the run's
seed and on the test's name only: ``KAFKA2PC_SEED=<n> pytest <test id>`` replays that test's draws.
"""

from __future__ import annotations

import hashlib
import os
import secrets

#: The environment variable that holds (or replays) the run's seed.
SEED_ENV = "KAFKA2PC_SEED"


def run_seed() -> int:
    """The run's seed: ``$KAFKA2PC_SEED``, or a fresh one drawn once and stored there."""
    raw = os.environ.get(SEED_ENV, "").strip()
    if raw:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"${SEED_ENV} must be an integer, not {raw!r}") from None
    seed = secrets.randbelow(1 << 31)
    os.environ[SEED_ENV] = str(seed)
    return seed


def seed_for(name: str) -> int:
    """A seed for ``name`` (a test's node id, a series), fixed by the run's seed."""
    digest = hashlib.sha256(f"{run_seed()}:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


def replay_hint(name: str) -> str:
    """The line a randomized test prints (and its failure report carries)."""
    return f"{SEED_ENV}={run_seed()} (seed {seed_for(name)} for {name}): set it to replay these draws"
