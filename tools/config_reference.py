"""Rewrite the tail of docs/configuration.md, from its "## Every key" heading to the end, with the
reference of every config key generated from the help on the config fields
(``ragen_mega.config_command.reference_markdown``). ``tests/test_run_config.py`` fails while the
page differs from it, so run this after adding or changing a key:

    python tools/config_reference.py
"""
from __future__ import annotations

from pathlib import Path

from ragen_mega.config_command import REFERENCE_HEADING, reference_markdown

PAGE = Path(__file__).parents[1] / "docs" / "configuration.md"


def main() -> None:
    text = PAGE.read_text()
    head, found, _ = text.partition(f"\n{REFERENCE_HEADING}\n")
    if not found:
        raise SystemExit(f"{PAGE}: no {REFERENCE_HEADING!r} heading to replace from")
    PAGE.write_text(f"{head}\n{reference_markdown()}")
    print(f"{PAGE}: reference rewritten")


if __name__ == "__main__":
    main()
