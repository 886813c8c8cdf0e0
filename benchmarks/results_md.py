"""Writing benchmarks/RESULTS.md: every benchmark replaces its own ``## `` section."""
from __future__ import annotations

from pathlib import Path


def write_section(path: Path, heading: str, text: str) -> None:
    """Replace (or append) one ``## `` section of RESULTS.md, leaving the others as they are."""
    old = path.read_text() if path.exists() else "# Benchmark results\n\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.strip() == heading), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        new = "".join(lines[:start]) + text.rstrip("\n") + "\n\n" + "".join(lines[end:])
    path.write_text(new.rstrip("\n") + "\n")
