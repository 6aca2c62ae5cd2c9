"""What the agent reads each turn, in the style of BALROG's BabaIsAI text::

    Active rules:
    key is win
    baba is you

    Objects on the map:
    rule `key` 5 steps to the left and 4 steps up
    ball 4 steps to the left and 2 steps up
    key 3 steps to the left

Rules are listed in reading order (transform rules ``A is B`` left out, as in BALROG); then
every top-of-cell object and word block, row-major, with its offset from you (BALROG's choice of
"you": :func:`you_position`). Colours are not printed; babas, the border and your own cell are
never listed. Unlike BALROG, every count above one reads "steps" (BALROG tested the signed
offset, so left and up always read "step").
"""
from __future__ import annotations

from ragen_mega.envs.babaisai.grid import Grid, Thing
from ragen_mega.envs.wording import steps

_LISTED_KINDS = {"noun", "is", "property"}  # plus objects other than baba


def offset_phrase(dx: int, dy: int) -> str:
    """``(-5, -4)`` -> "5 steps to the left and 4 steps up"; ``(0, 2)`` -> "2 steps down"."""
    vertical = steps(abs(dy), "down" if dy > 0 else "up") if dy else ""
    if not dx:
        return vertical
    horizontal = steps(abs(dx), "to the right" if dx > 0 else "to the left")
    return f"{horizontal} and {vertical}" if vertical else horizontal


def you_position(grid: Grid) -> tuple[int, int] | None:
    """The reference point of the offsets (BALROG's choice): the first object (row-major) of the
    last YOU rule's noun; if that noun has no object on the map, the previous YOU rule's, etc."""
    you_rules = [rule for rule in grid.rules.rules if rule.target == "you"]
    for rule in reversed(you_rules):
        for x, y, thing in grid.tops():
            if thing.kind == "object" and thing.name == rule.noun and grid.rules.has(thing, "you"):
                return x, y
    return None


def thing_name(thing: Thing) -> str | None:
    """How a thing is written, or None when it is not listed."""
    if thing.kind in _LISTED_KINDS:
        return f"rule `{thing.name}`"
    if thing.kind == "object" and thing.name != "baba":
        return thing.name
    return None


def rules_text(grid: Grid) -> str:
    lines = [rule.text() for rule in grid.rules.rules if not rule.is_transform]
    return "Active rules:" + "".join(f"\n{line}" for line in lines)


def render(grid: Grid, add_ruleset: bool = True) -> str:
    """The observation text; when nothing is YOU it says so instead of listing offsets."""
    parts = [rules_text(grid)] if add_ruleset else []
    you = you_position(grid)
    if you is None:
        parts.append("No object is YOU any more, so nothing can move.")
        return "\n\n".join(parts)
    lines = []
    for x, y, thing in grid.tops():
        name = thing_name(thing)
        if name is not None and (x, y) != you:
            lines.append(f"{name} {offset_phrase(x - you[0], y - you[1])}")
    parts.append("Objects on the map:\n" + "\n".join(lines))
    return "\n\n".join(parts)
