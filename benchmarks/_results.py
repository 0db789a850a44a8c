"""benchmarks/RESULTS.md: one section per benchmark, each rewritten only by its own script."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
TITLE = "# kafka2pc benchmarks\n"


def record_section(heading: str, body: str, path: Path = RESULTS) -> None:
    """Replace the ``## heading`` section of ``path`` with ``body`` (append it if missing); keep the others."""
    text = path.read_text() if path.exists() else TITLE
    section = f"## {heading}\n\n{body.strip()}\n"
    marker = f"## {heading}\n"
    if marker in text:
        start = text.index(marker)
        end = text.find("\n## ", start + len(marker))
        text = text[:start] + section + (text[end:] if end != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
