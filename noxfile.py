"""The Python matrix: ``nox`` (every session), ``nox -s tests-3.10``, ``nox -s docs``.

``tests`` runs, on each supported Python, the unit tests plus an integration
subset against the real broker and PostgreSQL (the same services the full suite
uses: ``$KAFKA2PC_PG_ADMIN_URL``, ``$KAFKA2PC_PORT_BASE``, ``$KAFKA_BOOTSTRAP_SERVERS``
pass through):

- core: crash recovery on the default broker line (the full suite runs it on every line), and the
  steady-state request count;
- recipe: the crash matrix (SQLite, every kill point, fewer runs of the COMMIT race),
  consume-transform-produce across crashes (PostgreSQL and SQLite), the asyncio writer's normal path
  (the rest of the recipe's tests run on one Python, in the full suite);
- the Django app's behaviour and misuse tests (SQLite, PostgreSQL, MariaDB), on Django 5.2 LTS on 3.10
  and on the newest Django 6.x on 3.13 (6.x needs Python 3.12+); its crash matrix and HTTP test run in
  the full suite;
- packaging: sdist -> wheel -> a clean virtualenv on that Python, no extras.

The property-based unit tests run a tenth of their examples here (``$KAFKA2PC_PROPERTY_EXAMPLES_SCALE``):
what they explore is the parser's logic, which the full suite explores in full.

SQLAlchemy is pinned per Python so that both supported lines are tested on purpose:
2.0.x on 3.10, 2.1.x on 3.13 (the full suite takes the newest, 2.1.x).

The full suite runs on one Python (``./scripts/test.sh``, 3.11 in CI); CI runs this session on
every other supported Python (3.10, 3.12, 3.13), so each of 3.10 to 3.13 is tested.  3.12 and 3.13 run
a smaller subset (``SUBSETS``).  Interpreters are
taken from ``$PATH`` or, when missing there, from pyenv (``~/.pyenv/versions``).
Extra arguments go to pytest: ``nox -s tests-3.13 -- -x -k crash``.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]

INTEGRATION_SUBSET = [
    "tests/core/test_crash_recovery.py",
    "tests/core/test_steady_state.py",
    "tests/recipes/sync/test_dual_write.py::test_consume_transform_produce_is_exactly_once_across_crashes",
    "tests/recipes/sync/test_dual_write_crash.py::test_crash_matrix[sqlite]",
    "tests/recipes/aio/test_async_dual_write.py::test_session_and_connection_commit_both_sides_through_the_same_steps",
    "tests/django/test_django_dual_write.py",
    "tests/testing/test_packaging.py",
]
OTHER_BROKER_LINES = [  # what differs between broker lines is the broker, not the Python: the full suite runs them
    f"tests/core/test_crash_recovery.py::{test}[{line}]"
    for test in ("test_prepared_and_stored_is_committed_after_kill",
                 "test_transaction_n_plus_1_is_aborted_when_the_database_kept_n")
    for line in ("previous", "legacy")
]

SUBSETS = {
    "3.12": ["tests/testing/test_packaging.py"],
    "3.13": ["tests/django/test_django_dual_write.py", "tests/testing/test_packaging.py"],
}
"""What a Python's session runs besides the unit tests, where it is not :data:`INTEGRATION_SUBSET`: 3.12, between
the ends, the packaging tests; 3.13, the newest, also the Django app on Django's newest major.  The whole
subset runs on 3.10 (with SQLAlchemy 2.0 and Django's LTS) and the full suite on 3.11."""

TEST_EXTRAS = "sql,postgres,mysql,cli,otel,aio,django"
"""The extras the ``test`` dependency group's tests import (scripts/setup.sh's GROUP_EXTRAS)."""

SQLALCHEMY_LINES = {"3.10": "2.0", "3.13": "2.1"}
"""The SQLAlchemy line each Python tests (the others take whatever pip resolves, today 2.1)."""

DJANGO_LINES = {"3.10": ("5.2", "5.3"), "3.12": ("5.2", "5.3"), "3.13": ("6", "7")}
"""The Django line each Python tests: the LTS on the oldest Python, the newest major on the newest."""

nox.options.sessions = ["tests", "docs"]
nox.options.default_venv_backend = "uv|venv"  # uv (dev extras) installs in seconds; venv without it
nox.options.reuse_existing_virtualenvs = True


def _add_pyenv_interpreters() -> None:
    """Put pyenv's interpreters on ``$PATH`` so nox finds ``python3.X`` without a pyenv shell."""
    versions = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    extra = []
    for wanted in PYTHONS:
        found = sorted(versions.glob(f"{wanted}.*/bin"), key=lambda p: [int(x) for x in p.parent.name.split(".")])
        if found:
            extra.append(str(found[-1]))
    if extra:
        os.environ["PATH"] = os.pathsep.join([*extra, os.environ.get("PATH", "")])


_add_pyenv_interpreters()


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """Unit tests plus this Python's integration subset (``INTEGRATION_SUBSET``, or ``SUBSETS``)."""
    session.install("-e", f".[{TEST_EXTRAS}]", "--group", "test")
    line = SQLALCHEMY_LINES.get(str(session.python))
    if line is not None:
        major, minor = line.split(".")
        session.install(f"sqlalchemy[asyncio]>={line},<{major}.{int(minor) + 1}")
        session.run("python", "-c", f"import sqlalchemy as sa; v = sa.__version__; print('SQLAlchemy', v); "
                    f"assert v.startswith('{line}.'), v")
    django_line = DJANGO_LINES.get(str(session.python))
    if django_line is not None:
        low, high = django_line
        session.install(f"django>={low},<{high}")
        session.run("python", "-c", f"import django; v = django.__version__; print('Django', v); "
                    f"assert v.startswith('{low}.'), v")
    deselect = [arg for test in OTHER_BROKER_LINES for arg in ("--deselect", test)]
    subset = {**{v: INTEGRATION_SUBSET for v in PYTHONS}, **SUBSETS}[str(session.python)]
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *deselect, "tests/unit", *subset,
                *session.posargs, env={"KAFKA2PC_CRASH_RACE_RUNS": "8", "KAFKA2PC_PROPERTY_EXAMPLES_SCALE": "0.1"})


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """Build the documentation site with warnings as errors (into ``site/``)."""
    session.install("-e", ".[cli]", "--group", "docs")
    session.run("mkdocs", "build", "--strict", "--quiet", "-d", "site", env={"NO_MKDOCS_2_WARNING": "1"})
