"""The documentation promises only what the code has.

For README.md and every hand-written page under docs/ (the changelog, which is history, and the
generated reference excepted), in prose, code spans and code blocks alike:

* **Dotted names.** Every ``kafka2pc.…`` name is a module, class, function or attribute that
  imports (``kafka2pc.recipes.spark.recover``), or a string the code uses whole: a configuration
  key (``kafka2pc.delivery.reports``), a data-source option (``kafka2pc.runId``), a metric, span,
  attribute or logger name.
* **Metric names.** Where a line names a metric (a table row of Counters, Gauges and Histograms,
  or a ``create_counter``/``create_*gauge``/``create_histogram`` call), the name is one that
  :class:`kafka2pc.otel.Telemetry` registers.
* **Configuration.** Every key of the producer's configuration table (docs/configuration.md)
  is one the code reads or sets; every ``KAFKA2PC_*`` environment variable is one the
  repository reads.
* **The command line.** Every ``kafka2pc <command> … --option`` written as code names a command
  of the ``kafka2pc`` click tree and options that command (or a group above it) has.

A failure names the page, the line and the claim.  A page may quote a name that does not exist
on purpose only inside an HTML comment.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import click
import pytest

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO
"""Where the pages are (the self-test points it at its own page)."""
SOURCES = ("kafka2pc", "recipes", "cli")
"""The package's source trees (``recipes`` and ``cli`` install as ``kafka2pc.recipes``, ``kafka2pc.cli``)."""

EXEMPT = {"docs/changelog.md": "mirrors CHANGELOG.md: history names what no longer exists"}

COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
DOTTED = re.compile(r"(?<![\w/.:\[-])kafka2pc(?:\.[A-Za-z_][A-Za-z0-9_]*)+(?![\w*/-])")
"""A dotted name, not a host name in a link (``kafka2pc.github.io/…``) or a pattern (``kafka2pc._*``)."""
ENV_VAR = re.compile(r"(?<![\w$])\$?(KAFKA2PC_[A-Z0-9_]+)\b")
METRIC_LINE = re.compile(r"\|\s*(?:Counter|Gauge|Histogram|UpDownCounter)\s*\||create_(?:counter|histogram|"
                         r"observable_gauge|gauge|up_down_counter|observable_counter)\(")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w-]*)")


def pages() -> list[Path]:
    found = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [p for p in found if "reference" not in p.relative_to(REPO).parts
            and str(p.relative_to(REPO)) not in EXEMPT]


@dataclass(frozen=True)
class Line:
    number: int
    text: str
    block: str | None
    """The fenced block's language (``""`` when none) if the line is inside one, else ``None``."""


def lines_of(page: Path) -> Iterator[Line]:
    """The page's lines with HTML comments blanked (line numbers kept), each with the block it is in."""
    text = COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text(encoding="utf-8"))
    fence: str | None = None
    language = ""
    for number, line in enumerate(text.splitlines(), start=1):
        m = FENCE.match(line)
        if fence is None and m:
            fence, language = m.group(1)[0] * len(m.group(1)), m.group(2)
            continue
        if fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            fence = None
            continue
        yield Line(number, line, language if fence is not None else None)


# -- what exists ----------------------------------------------------------------------------------
@cache
def source_literals() -> frozenset[str]:
    """Every string constant of the package's sources, whole (f-strings' constant parts too)."""
    found: set[str] = set()
    for tree in SOURCES:
        for path in (REPO / tree).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.add(node.value)
    return frozenset(found)


@cache
def repository_text() -> str:
    """The sources, tests and scripts: where an environment variable is read."""
    paths = [p for tree in (*SOURCES, "tests", "scripts", "examples", "benchmarks") for p in (REPO / tree).rglob("*")
             if p.suffix in (".py", ".sh") and p.resolve() != Path(__file__).resolve()]
    paths += [REPO / "noxfile.py", REPO / ".ci" / "run"]
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in paths if p.is_file())


@cache
def metric_names() -> frozenset[str]:
    """The instruments :class:`kafka2pc.otel.Telemetry` creates (recorded through a meter provider) and ``stats`` exports."""
    from opentelemetry.metrics import NoOpMeter, NoOpMeterProvider

    from kafka2pc.otel import Telemetry

    names: set[str] = set()

    class RecordingMeter(NoOpMeter):
        def __getattribute__(self, attribute: str) -> Any:
            found = super().__getattribute__(attribute)
            if not attribute.startswith("create_"):
                return found

            def create(name: str, *args: Any, **kwargs: Any) -> Any:
                names.add(name)
                return found(name, *args, **kwargs)

            return create

    class RecordingProvider(NoOpMeterProvider):
        def get_meter(self, name: str, *args: Any, **kwargs: Any) -> NoOpMeter:
            return RecordingMeter(name)

    Telemetry(meter_provider=RecordingProvider())
    assert names, "kafka2pc.otel.Telemetry created no instrument: the recorder missed them"
    # The cluster figures that `kafka2pc stats --otel / --prometheus` exports (one table, kafka2pc.cli._metrics).
    from kafka2pc.cli._metrics import COLLECTION_FAILURES, METRICS

    names.update(metric.otel_name for metric in (*METRICS, COLLECTION_FAILURES))
    return frozenset(names)


def resolves(dotted: str) -> bool:
    """Does ``dotted`` import, as a module or an attribute of one (deprecated names too)?"""
    parts = dotted.split(".")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cut in range(len(parts), 0, -1):
            try:
                obj: Any = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for name in parts[cut:]:
                    obj = getattr(obj, name)
            except AttributeError:
                return False
            return True
    return False


@cache
def cli_root() -> click.Group:
    from kafka2pc.cli import cli

    assert isinstance(cli, click.Group)
    return cli


# -- the claims -----------------------------------------------------------------------------------
def dotted_problems(page: Path) -> list[str]:
    rel = page.relative_to(ROOT)
    problems = []
    after_create = False
    for line in lines_of(page):
        metric_line = METRIC_LINE.search(line.text) is not None or after_create
        after_create = line.text.rstrip().endswith("(") and METRIC_LINE.search(line.text) is not None
        for match in DOTTED.finditer(line.text):
            name = match.group(0)
            if metric_line and name not in metric_names() and not resolves(name):
                problems.append(f"{rel}:{line.number}: `{name}`: not a metric kafka2pc records "
                                f"(it records {', '.join(sorted(metric_names()))})")
            elif not resolves(name) and name not in source_literals() and name not in metric_names():
                problems.append(f"{rel}:{line.number}: `{name}`: no such module, class, function or attribute, "
                                "and no configuration key, option, metric, span or logger name in the code")
    return problems


def config_problems(page: Path) -> list[str]:
    rel = page.relative_to(ROOT)
    problems = []
    in_key_table = False
    for line in lines_of(page):
        if line.block is None and line.text.startswith("## "):
            in_key_table = rel.as_posix() == "docs/configuration.md" and "configuration dict" in line.text
        if in_key_table and line.block is None and line.text.startswith("| `"):
            first = line.text.strip("|").split("|")[0]
            for key in CODE_SPAN.findall(first):
                if "*" not in key and key not in source_literals():
                    problems.append(f"{rel}:{line.number}: configuration key `{key}`: the code neither reads nor "
                                    "sets it")
        for var in ENV_VAR.findall(line.text):
            if var not in repository_text():
                problems.append(f"{rel}:{line.number}: environment variable `{var}`: nothing in the repository "
                                "reads it")
    return problems


def cli_commands(line: Line) -> Iterator[str]:
    """The ``kafka2pc …`` command lines written as code on ``line`` (the text after ``kafka2pc``)."""
    if line.block is not None:
        if line.block in ("bash", "sh", "shell", "console", ""):
            for part in re.split(r"&&|\|\||;|\|", line.text.split(" #", 1)[0]):
                m = re.match(r"\s*(?:\$\s+)?(?:\S*/)?kafka2pc\s+(.*)", part)
                if m:
                    yield m.group(1)
        return
    for span in CODE_SPAN.findall(line.text):
        m = re.match(r"(?:\S*/)?kafka2pc\s+(.*)", span)
        if m:
            yield m.group(1)


def cli_problems(page: Path) -> list[str]:
    rel = page.relative_to(ROOT)
    problems = []
    for line in lines_of(page):
        for rest in cli_commands(line):
            words = rest.split()
            command: click.Command = cli_root()
            chain: list[click.Command] = [command]
            path = ["kafka2pc"]
            i = 0
            while isinstance(command, click.Group) and i < len(words) and not words[i].startswith("-"):
                sub = command.commands.get(words[i])
                if sub is None:
                    if re.fullmatch(r"[a-z][a-z-]*", words[i]):
                        problems.append(f"{rel}:{line.number}: `kafka2pc {rest}`: {' '.join(path)} has no command "
                                        f"{words[i]!r} (it has {', '.join(sorted(command.commands))})")
                    break
                command, i = sub, i + 1
                chain.append(command)
                path.append(sub.name or "")
            known = {"--help"}
            for cmd in chain:
                for param in cmd.params:
                    known.update(getattr(param, "opts", []))
                    known.update(getattr(param, "secondary_opts", []))
            for word in words[i:]:
                option = word.split("=", 1)[0]
                if re.fullmatch(r"--?[A-Za-z][\w-]*", option) and option not in known:
                    problems.append(f"{rel}:{line.number}: `kafka2pc {rest}`: {' '.join(path)} has no option "
                                    f"{option}")
    return problems


PAGES = pages()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_claim_of_the_page_exists(page: Path) -> None:
    problems = dotted_problems(page) + config_problems(page) + cli_problems(page)
    assert not problems, "the page names what the code does not have:\n" + "\n".join(problems)


def test_the_checks_catch_false_claims(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check fires on a claim that is false, and stays quiet on the true one beside it."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "configuration.md"
    page.write_text(
        "## The producer's configuration dict\n\n"
        "| `kafka2pc.delivery.reports` | x |\n| `kafka2pc.no.such.key` | x |\n\n"
        "Bounded by `kafka2pc.NO_SUCH_TIMEOUT_S`; see `kafka2pc.recipes.spark.recover`.\n"
        "| `kafka2pc.transactions.committed` | Counter | n |\n| `kafka2pc.in_doubt_transactions` | Gauge | n |\n"
        "Run `kafka2pc list --min-open 5m` or `kafka2pc lst` or `kafka2pc list --no-such-option`.\n"
        "<!-- `kafka2pc.quoted_in_a_comment` -->\n"
        "```bash\nkafka2pc describe some-id --timeout 5   # fine\nkafka2pc describe --colour\n```\n"
        "```python\nmeter.create_observable_gauge(\n    \"kafka2pc.transaction.open.age\", unit=\"s\")\n"
        "meter.create_observable_gauge(\n    \"kafka2pc.delivery.reports\")\n```\n"
        "Set `KAFKA2PC_PORT_BASE`, not `KAFKA2PC_NO_SUCH_VARIABLE`.\n"
    )
    found = "\n".join(dotted_problems(page) + config_problems(page) + cli_problems(page))
    assert "`kafka2pc.delivery.reports`: not a metric" in found  # a key exists, but not as a metric
    for claim in ("`kafka2pc.no.such.key`", "`kafka2pc.NO_SUCH_TIMEOUT_S`", "`kafka2pc.in_doubt_transactions`",
                  "no command 'lst'", "has no option --no-such-option", "has no option --colour",
                  "`KAFKA2PC_NO_SUCH_VARIABLE`"):
        assert claim in found, (claim, found)
    for true in ("recover`", "transactions.committed`", "open.age`", "--min-open",
                 "quoted_in_a_comment", "--timeout", "`KAFKA2PC_PORT_BASE`"):
        assert true not in found, (true, found)
    assert "docs/configuration.md:4: `kafka2pc.no.such.key`" in found  # page, line and claim
