"""The documentation's links hold: every relative link in README.md, docs/*.md and
benchmarks/README.md names a file that exists and, with ``#anchor``, a heading of that file (by
GitHub's rule: lower case, punctuation dropped, spaces to hyphens)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_and_anchor_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "benchmarks" / "README.md"]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path) if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in {
                    slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
