"""Matching a model's action text against an env's action words.

Models write "Turn left", "turn  left", "TURN_LEFT", "[turn left]." or a 100 KB ramble; all but
the last reach the same action, and none raises. Matching ignores case, outer and repeated
whitespace, outer punctuation, quotes and brackets, and reads "_" as a space (crafter's
"move_left", BALROG's "move left"). Anything else is no match: an invalid-action step.
"""
from __future__ import annotations

from typing import Sequence

_PREVIEW_CHARS = 40
_OUTER_PUNCTUATION = " \t\n.,!?;:'\"`*[](){}"


def normalize_action(text: str) -> str:
    """Canonical spelling: lower case, "_" as space, single spaces, no outer whitespace or
    punctuation."""
    return " ".join(text.replace("_", " ").lower().split()).strip(_OUTER_PUNCTUATION)


def match_action(text: object, actions: Sequence[str]) -> int | None:
    """Index of ``text`` in ``actions`` (written in canonical spelling), or None if none matches."""
    if not isinstance(text, str):
        return None
    longest = max(len(a) for a in actions)
    if len(text) > 4 * longest + 16:  # no padding makes text this long an action; skip the work
        return None
    canonical = normalize_action(text)
    return actions.index(canonical) if canonical in actions else None


def unknown_action_reason(text: object, actions: Sequence[str]) -> str:
    """A short, bounded explanation for ``info['invalid_reason']`` (never echoes 100 KB back)."""
    if isinstance(text, str):
        shown = repr(text[:_PREVIEW_CHARS]) + ("..." if len(text) > _PREVIEW_CHARS else "")
    else:
        shown = f"a {type(text).__name__} (not text)"
    return f"unknown action {shown}; valid actions: {', '.join(actions)}"
