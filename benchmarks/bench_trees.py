"""One benchmark from two checkouts, interleaved: what a change did to its figures.

``python benchmarks/bench_trees.py --before ../old --after . --runs 3 -- bench_dual_write.py --rounds 4``

Each run starts the benchmark script once from each checkout (with that checkout's ``.venv``, from its
directory, with ``--no-record``), the two in turns (before first in odd runs, after first in even ones),
so that the shared machine's drift falls on both. The script's first Markdown table is read from its
standard output; for every row (keyed by its leading integer columns) and every numeric column, the
ratio after / before is taken per run, and its median with min..max is printed. Columns that are
already ratios within one run (``... / non-atomic``) are the figures to read: each carries its own
baseline, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

_NUMBER = re.compile(r"^\**(-?[0-9]+(?:\.[0-9]+)?)x?\**$")


def first_table(output: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the first Markdown table of ``output`` (its last printing, if printed twice)."""
    tables: list[tuple[list[str], list[list[str]]]] = []
    lines = output.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = [c.strip() for c in lines[i].strip("|").split("|")]
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("| ") and not (
                i + 1 < len(lines) and lines[i + 1].startswith("|---")  # the next table's header
            ):
                rows.append([c.strip() for c in lines[i].strip("|").split("|")])
                i += 1
            tables.append((header, rows))
        else:
            i += 1
    if not tables:
        raise SystemExit(f"no Markdown table in the benchmark's output:\n{output[-2000:]}")
    wanted = tables[0][0]
    return [t for t in tables if t[0] == wanted][-1]


def number(cell: str) -> float | None:
    match = _NUMBER.match(cell.replace(",", ""))
    return float(match.group(1)) if match else None


def run_once(tree: Path, script: str, args: list[str]) -> tuple[list[str], list[list[str]]]:
    python = tree / ".venv" / "bin" / "python"
    command = [str(python), str(tree / "benchmarks" / script), "--no-record", *args]
    print(f"bench_trees: {tree}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": ""})
    if done.returncode != 0:
        raise SystemExit(f"{tree}: the benchmark exited {done.returncode}:\n{done.stderr[-3000:]}")
    return first_table(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the checkout before the change")
    parser.add_argument("--after", type=Path, required=True, help="the checkout after the change")
    parser.add_argument("--runs", type=int, default=3, help="runs of each checkout, interleaved")
    parser.add_argument("script", help="the benchmark, a file name under benchmarks/")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's arguments (after --)")
    options = parser.parse_args()
    args = [a for a in options.args if a != "--"]
    results: dict[str, list[tuple[list[str], list[list[str]]]]] = {"before": [], "after": []}
    for n in range(options.runs):
        order = ["before", "after"] if n % 2 == 0 else ["after", "before"]
        for side in order:
            results[side].append(run_once(getattr(options, side).resolve(), options.script, args))
    header = results["after"][0][0]
    print(f"{options.script} {' '.join(args)}: after / before, median of {options.runs} interleaved runs "
          f"(min..max); load average at the end {os.getloadavg()[0]:.1f}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for index, row in enumerate(results["after"][0][1]):
        cells = []
        for col, cell in enumerate(row):
            pairs = [(number(a[1][index][col]), number(b[1][index][col]))
                     for a, b in zip(results["after"], results["before"], strict=True)]
            ratios = [a / b for a, b in pairs if a is not None and b]
            if len(ratios) != len(pairs) or col < 2 and number(cell) is not None and float(cell) == int(float(cell)):
                cells.append(cell)
            else:
                cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})")
        print("| " + " | ".join(cells) + " |")
    print("\nthe same figures, each run:")
    for side in ("before", "after"):
        for header_rows in results[side]:
            for row in header_rows[1]:
                print(f"{side}: | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
