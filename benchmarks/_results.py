"""benchmarks/RESULTS.md: one section per benchmark, each rewritten only by its own script."""

from __future__ import annotations

import cProfile
import io
import pstats
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


def merged_profile(profiles: list[cProfile.Profile], sort: str, top: int, dump: str | None = None) -> str:
    """Every thread's profile merged into one (each stopped first; a thread that recorded nothing is left out):
    its ``top`` entries by ``sort``, as text; with ``dump``, the merged profile is written there too."""
    for profile in profiles:
        profile.disable()  # only stops the calling thread's; the snapshot is what each recorded
    stats = pstats.Stats(profiles[0])
    for profile in profiles[1:]:
        try:
            stats.add(profile)
        except TypeError:  # a thread that recorded nothing
            pass
    if dump:
        stats.dump_stats(dump)
    out = io.StringIO()
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats(sort).print_stats(top)
    return out.getvalue()
