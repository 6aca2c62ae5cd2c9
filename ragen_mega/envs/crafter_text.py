"""Crafter's state in words, in the style of BALROG's Crafter wrapper.

Read from the world (materials and creatures), not the image, so nothing is rendered. Covers
what the agent's image would show, the 9x7 cells around the player: the nearest thing of each
kind with its offset, "tree 1 step up and 2 steps left". Ground (grass, sand, path) is left out
as in BALROG, except in the faced cell, which is always named ("do" on grass can yield a
sapling). Directions are crafter's: "left" is x - 1 (where "move left" goes), "up" is y - 1.
"""
from __future__ import annotations

from crafter import constants

from ragen_mega.envs.wording import steps

#: BALROG skips these when listing what is around: they are everywhere and would swamp the text
GROUND = frozenset({"grass", "sand", "path"})
VITALS = ("health", "food", "drink", "energy")
_FACING_NAMES = {(-1, 0): "left", (1, 0): "right", (0, -1): "up", (0, 1): "down"}


def relative_position(dx: int, dy: int) -> str:
    """Offset in words, vertical part first: "1 step up and 2 steps left"."""
    parts = []
    if dy:
        parts.append(steps(abs(dy), "down" if dy > 0 else "up"))
    if dx:
        parts.append(steps(abs(dx), "right" if dx > 0 else "left"))
    return " and ".join(parts)


def thing_name(material: str | None, obj) -> str | None:
    """What occupies a cell: the creature/plant/arrow on it if any, else its material."""
    if obj is None:
        return material
    name = type(obj).__name__.lower()
    if name == "plant" and obj.ripe:
        return "ripe plant"
    return name


def nearby_things(world, player, view: tuple[int, int]) -> list[tuple[str, int, int]]:
    """``(name, dx, dy)`` of the nearest thing of each kind in the ``view`` (w, h) around the
    player, nearest first; ground and the player itself are left out."""
    px, py = (int(c) for c in player.pos)
    half_w, half_h = view[0] // 2, view[1] // 2
    nearest: dict[str, tuple[int, int, int]] = {}
    for dx in range(-half_w, half_w + 1):
        for dy in range(-half_h, half_h + 1):
            if dx == dy == 0:
                continue
            name = thing_name(*world[(px + dx, py + dy)])
            if name is None or name in GROUND:
                continue
            key = (abs(dx) + abs(dy), dy, dx)
            if name not in nearest or key < nearest[name]:
                nearest[name] = key
    ordered = sorted((key, name) for name, key in nearest.items())
    return [(name, dx, dy) for (_, dy, dx), name in ordered]


def describe(world, player, view: tuple[int, int]) -> str:
    """The observation text: surroundings, the faced cell, status, inventory."""
    things = nearby_things(world, player, view)
    lines = ["You see:", *(f"- {name} {relative_position(dx, dy)}" for name, dx, dy in things)]
    if not things:
        lines = ["You see nothing but ground around you."]
    facing = tuple(int(c) for c in player.facing)
    target = (int(player.pos[0]) + facing[0], int(player.pos[1]) + facing[1])
    front = thing_name(*world[target]) or "the edge of the world"
    lines.append(f"You are facing {_FACING_NAMES[facing]}; in front of you: {front}.")
    if player.sleeping:
        lines.append("You are sleeping; you wake up when your energy is restored.")
    inventory = player.inventory
    lines.append("Status: " + ", ".join(
        f"{v} {inventory[v]}/{constants.items[v]['max']}" for v in VITALS) + ".")
    items = [f"{name.replace('_', ' ')} {count}" for name, count in inventory.items()
             if name not in VITALS and count > 0]
    lines.append("Inventory: " + (", ".join(items) if items else "nothing") + ".")
    return "\n".join(lines)
