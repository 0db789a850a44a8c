"""The documentation describes the product as it is, in pages a reader can finish.

The rules, for README.md and every page under docs/ (``docs/changelog.md`` excepted: it
mirrors CHANGELOG.md, where history belongs; ``docs/reference/`` is generated from the code):

* **No project history.** No issue or pull-request numbers (``#12``, "issue 12"), no
  "the issue", no "goal" and no "not met": a page says what the product does, and what was
  planned, tried or measured against a target goes to the CHANGELOG or git.
* **A word budget.** A page has at most :data:`WORD_BUDGET` words.  Words are the
  whitespace-separated tokens outside fenced code blocks and HTML comments (code, output and
  tables of commands are not what makes a page long to read; tables of prose are counted).

Code spans and fenced blocks are not searched for history either: a log line or a URL
quoted as it is may contain ``#`` and digits.

New pages are picked up automatically.  :data:`BEING_REWRITTEN` lists the pages that break a
rule today and are being rewritten elsewhere; a listed page that no longer breaks any rule
fails the test, so the list only shrinks.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORD_BUDGET = 2500
#: Pages exempt from the rules, and why.
EXEMPT = {"docs/changelog.md": "mirrors CHANGELOG.md, the place for history"}
#: Pages that break a rule today and are being rewritten by their owners; remove an entry once
#: its page follows the rules (the test says when).
BEING_REWRITTEN: dict[str, str] = {}

FENCE = re.compile(r"^\s*(```+|~~~+)")
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HISTORY = {
    "an issue or pull-request number": re.compile(r"(?<![\w/&])#\d+\b|\b(?:issue|PR|pull request)s? #?\d+\b", re.I),
    '"the issue"': re.compile(r"\bthe issue\b", re.I),
    '"goal"': re.compile(r"\bgoals?\b", re.I),
    '"not met"': re.compile(r"\bnot\s+(?:\*\*)?met\b", re.I),
}


def pages() -> list[Path]:
    """README.md and every hand-written page under docs/."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in found if "reference" not in p.relative_to(ROOT).parts
            and str(p.relative_to(ROOT)) not in EXEMPT]


def outside_code(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every line outside fenced code blocks and HTML comments."""
    text = COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    lines: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
        else:
            lines.append((number, line))
    return lines


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside code, with code spans blanked out: what the history rules search."""
    return [(number, CODE_SPAN.sub(" code ", line)) for number, line in outside_code(text)]


def words(text: str) -> int:
    """Whitespace-separated tokens outside fenced code blocks and HTML comments."""
    return sum(len(line.split()) for _, line in outside_code(text))


def problems_of(page: Path, root: Path = ROOT) -> list[str]:
    """Every rule ``page`` breaks, one line each."""
    rel = str(page.relative_to(root))
    text = page.read_text(encoding="utf-8")
    found = [f"{rel}:{number}: {what}: {line.strip()[:120]}"
             for number, line in prose_lines(text)
             for what, pattern in HISTORY.items() if pattern.search(line)]
    n = words(text)
    if n > WORD_BUDGET:
        found.append(f"{rel}: {n} words, over the budget of {WORD_BUDGET}: split it by task, or move "
                     "measurements to docs/benchmarks.md and test methodology to docs/testing.md")
    return found


def test_pages_state_no_history_and_keep_to_the_word_budget() -> None:
    problems, fixed = [], []
    for page in pages():
        rel = str(page.relative_to(ROOT))
        found = problems_of(page)
        if rel in BEING_REWRITTEN:
            if not found:
                fixed.append(f"{rel} follows the rules now: remove it from BEING_REWRITTEN")
            continue
        problems += found
    assert not problems and not fixed, "\n".join(problems + fixed)


def test_every_listed_page_exists() -> None:
    missing = [p for p in [*EXEMPT, *BEING_REWRITTEN] if not (ROOT / p).is_file()]
    assert not missing, missing


def test_the_rules_catch_what_they_name(tmp_path: Path) -> None:
    """Each rule fires on a line that breaks it, and stays quiet on code, comments and anchors."""
    bad = {
        "Fixed in #12.": "an issue or pull-request number",
        "See issue 14 for the numbers.": "an issue or pull-request number",
        "The issue asks for 1.0x.": '"the issue"',
        "The goal of 1.0x is reached.": '"goal"',
        "Throughput is **not met** here.": '"not met"',
    }
    for line, rule in bad.items():
        found = [what for _, text in prose_lines(line) for what, p in HISTORY.items() if p.search(text)]
        assert found == [rule], (line, found)
    quiet = ("See [the state table](dual-write.md#the-state-table) and `rdkafka#producer-1`.\n"
             "<!-- not-run: issue #3 -->\n```text\nipv4#127.0.0.1:9092 #42\n```\n&#39; is a quote.\n")
    assert [what for _, text in prose_lines(quiet) for what, p in HISTORY.items() if p.search(text)] == []
    assert words("one two\n```python\nnot counted here\n```\n<!-- nor\nthis -->\nthree\n") == 3
    page = tmp_path / "docs" / "long.md"
    page.parent.mkdir()
    page.write_text("word " * (WORD_BUDGET + 1))
    [problem] = problems_of(page, tmp_path)
    assert problem.startswith(f"docs/long.md: {WORD_BUDGET + 1} words, over the budget of {WORD_BUDGET}"), problem
    page.write_text("word " * WORD_BUDGET)
    assert problems_of(page, tmp_path) == []
