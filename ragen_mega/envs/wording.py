"""Phrases the text renderings of several envs share, so they read alike."""
from __future__ import annotations


def steps(count: int, direction: str) -> str:
    """``steps(1, "left") == "1 step left"``, ``steps(3, "up") == "3 steps up"``."""
    return f"{count} step{'' if count == 1 else 's'} {direction}"
