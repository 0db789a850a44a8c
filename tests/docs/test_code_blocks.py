"""Every code block of README.md and docs/**/*.md that claims to run, run as written.

The convention (also in README.md, "Developing"):

* A fenced block tagged ``python`` (or ``py``) or a shell (``bash``, ``sh``, ``shell``,
  ``console``) claims to run.  Blocks with another tag or none (output, SQL, JSON,
  properties files, diagrams) are displays and are not run.
* A runnable block preceded by ``<!-- not-run: REASON -->`` (the nearest non-blank line
  above the fence) is not run; the reason is required (installing packages, stopping
  shared services, a sketch with the application's own objects...).
* The blocks of one page run in page order in one fresh process, as a reader pasting
  them one after another: Python blocks share one namespace and one event loop
  (top-level ``await`` works as in ``python -m asyncio``), shell blocks run with
  ``bash -euo pipefail``, all in a fresh working directory.
* They find the services through the environment, as the docs tell users:
  ``$KAFKA_BOOTSTRAP_SERVERS`` is the test session's broker and ``$DATABASE_URL`` a
  fresh database; a page that uses ``DATABASE_URL`` runs once each on SQLite,
  PostgreSQL and MariaDB.  The topic ``orders`` exists (README.md's first example
  creates it; every page may assume it).

Each Python block of README.md also stands on its own (it defines every name it uses), since a
reader may paste just one.

New pages are picked up automatically.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("_run_blocks.py")
PYTHON_TAGS = {"python", "py"}
SHELL_TAGS = {"bash", "sh", "shell", "console"}
NOT_RUN = re.compile(r"^<!--\s*not-run:(?P<reason>.*?)-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)(?P<info>.*)$")
PAGE_TIMEOUT_S = 240
DEFAULT_MARIADB_URL = "mysql+pymysql://kafka2pc:kafka2pc@127.0.0.1:3306/kafka2pc"


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the block's first source line
    tag: str
    source: str
    not_run: str | None  # the reason, if marked <!-- not-run: ... -->

    @property
    def kind(self) -> str | None:
        return "python" if self.tag in PYTHON_TAGS else "shell" if self.tag in SHELL_TAGS else None

    @property
    def runs(self) -> bool:
        return self.kind is not None and self.not_run is None


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks_of(page: Path, root: Path = ROOT) -> list[Block]:
    """The fenced blocks of ``page``; raises ValueError on an unclosed fence."""
    lines = page.read_text(encoding="utf-8").splitlines()
    rel = str(page.relative_to(root))
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        tag = (m["info"].strip().split() or [""])[0].strip("{}.").lower()
        previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(previous)
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence[0] * len(fence))
                                      and not lines[j].strip().strip(fence[0])):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        if j == len(lines):
            raise ValueError(f"{rel}:{i + 1}: unclosed code fence")
        found.append(Block(rel, i + 2, tag, "\n".join(body) + "\n",
                           marker["reason"].strip() if marker else None))
        i = j + 1
    return found


def _cases() -> list[object]:
    cases: list[object] = []
    for page in pages():
        runnable = [b for b in blocks_of(page) if b.runs]
        if not runnable:
            continue
        rel = str(page.relative_to(ROOT))
        if any("DATABASE_URL" in b.source for b in runnable):
            cases += [pytest.param(rel, db, id=f"{rel}-{db}") for db in ("sqlite", "postgresql", "mariadb")]
        else:
            cases.append(pytest.param(rel, None, id=rel))
    return cases


@pytest.fixture
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str | None]:
    """A fresh database of the family the case names (None: the page needs none)."""
    family = request.node.callspec.params["db"]
    if family is None:
        yield None
    elif family == "sqlite":
        yield f"sqlite:///{tmp_path / 'app.db'}"
    elif family == "postgresql":
        from kafka2pc.testing.postgres import PostgresUnavailable, fresh_database

        try:
            with fresh_database() as url:
                yield url
        except PostgresUnavailable as exc:
            pytest.fail(str(exc), pytrace=False)
    else:
        base = sa.make_url(os.environ.get("KAFKA2PC_MARIADB_URL", DEFAULT_MARIADB_URL))
        name = f"k2pc_docs_{uuid.uuid4().hex[:10]}"
        admin = sa.create_engine(base, poolclass=sa.pool.NullPool, connect_args={"connect_timeout": 5})
        try:
            with admin.begin() as conn:
                conn.exec_driver_sql(f"CREATE DATABASE {name}")
        except sa.exc.OperationalError as exc:
            pytest.fail(f"MariaDB is not reachable ({exc.orig}); start it with scripts/start-mariadb.sh",
                        pytrace=False)
        try:
            yield base.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.begin() as conn:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
            admin.dispose()


@pytest.fixture(scope="session")
def orders_topic(kafka_bootstrap: str) -> str:
    """The topic every page may assume (README.md creates it the same way, idempotently)."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    from kafka2pc._logging import with_librdkafka_logger

    admin = AdminClient(with_librdkafka_logger({"bootstrap.servers": kafka_bootstrap}))
    error = admin.create_topics([NewTopic("orders", 3)])["orders"].exception(30)
    assert error is None or "already exists" in str(error), error
    return "orders"


@pytest.mark.parametrize(("page", "db"), _cases())
def test_page_runs_as_written(
    page: str, db: str | None, database_url: str | None, kafka_bootstrap: str, orders_topic: str, tmp_path: Path
) -> None:
    blocks = [b for b in blocks_of(ROOT / page) if b.runs]
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([{"kind": b.kind, "path": b.path, "line": b.line, "source": b.source}
                                for b in blocks]))
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("DATABASE_URL", None)
    if database_url is not None:
        env["DATABASE_URL"] = database_url
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    done = subprocess.run([sys.executable, str(RUNNER), str(spec)], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=PAGE_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"{page}: a code block failed\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    ran = re.findall(r"^ran (\S+) in", done.stderr, re.MULTILINE)
    assert ran == [f"{b.path}:{b.line}" for b in blocks], done.stderr


def test_every_runnable_block_runs_or_says_why_not() -> None:
    """A ``not-run`` marker needs a reason; a page's fences are balanced; some blocks do run."""
    problems, running = [], 0
    for page in pages():
        for b in blocks_of(page):
            if b.not_run is not None and not b.not_run:
                problems.append(f"{b.path}:{b.line}: <!-- not-run: --> without a reason")
            if b.not_run is not None and b.kind is None:
                problems.append(f"{b.path}:{b.line}: not-run marker on a ```{b.tag} block, which never runs")
            running += b.runs
    assert not problems, "\n".join(problems)
    assert running >= 10, f"only {running} code blocks run"


def test_the_parser_reads_markers_and_fences(tmp_path: Path) -> None:
    docs = tmp_path / "page.md"
    docs.write_text("intro\n\n<!-- not-run: installs packages -->\n```bash\npip install x\n```\n\n"
                    "```python\nprint(1)\n```\n\n- item\n\n    ```sh\n    echo hi\n    ```\n\n```\nout\n```\n")
    found = blocks_of(docs, tmp_path)
    assert [(b.tag, b.line, b.runs, b.not_run) for b in found] == [
        ("bash", 5, False, "installs packages"),
        ("python", 9, True, None),
        ("sh", 15, True, None),
        ("", 19, False, None),
    ]
    assert found[2].source == "echo hi\n"


def _names_used_but_not_defined(source: str) -> set[str]:
    """Names a block reads that neither it nor the builtins define (a rough, scope-blind reading)."""
    import ast
    import builtins

    tree = ast.parse(source)
    defined = set(dir(builtins))
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.alias):
            defined.add((node.asname or node.name).split(".")[0])
    return used - defined


def test_each_readme_python_block_runs_on_its_own() -> None:
    """A reader may paste any one block of the README: each defines what it uses (``bootstrap``...)."""
    problems = [f"{b.path}:{b.line}: uses {sorted(missing)} without defining them"
                for b in blocks_of(ROOT / "README.md") if b.runs and b.kind == "python"
                if (missing := _names_used_but_not_defined(b.source))]
    assert not problems, "\n".join(problems)
    assert _names_used_but_not_defined("import os\nx = os.environ\nprint(bootstrap)\n") == {"bootstrap"}
