"""A planner for BabaIsAI levels, written for the tests: uniform-cost search over the real
engine's states, in Sokoban style.

A search node is a grid. With one YOU object, its free walking (onto empty cells and objects
that are neither STOP, PUSH, WIN nor LOSE) changes nothing but its own position, so a node stands
for the YOU's whole walkable region; edges are the moves out of that region (a push, a move onto
a WIN or LOSE thing), each simulated by the engine from the cell next to it. With several or no
YOU objects every action is an edge. Node cost is the number of primitive actions, so the first
win popped is the shortest plan under this model; the tests then replay the plan, action by
action, through the env from a fresh reset, which is the actual check.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque

from ragen_mega.envs.babaisai.grid import DIRECTIONS, Grid

_SPECIAL = ("stop", "push", "win", "lose")
WEIGHT = 2


def _walkable(grid: Grid, x: int, y: int) -> bool:
    thing = grid.top(x, y)
    return thing is None or (thing.kind == "object"
                             and not any(grid.rules.has(thing, p) for p in _SPECIAL))


def _region(grid: Grid, start: tuple[int, int]) -> dict[tuple[int, int], list[str]]:
    """Cells the YOU at ``start`` walks to freely, with the shortest action path to each."""
    paths = {start: []}
    queue = deque([start])
    while queue:
        x, y = queue.popleft()
        for name, (dx, dy) in DIRECTIONS.items():
            cell = (x + dx, y + dy)
            if cell not in paths and grid.inside(*cell) and _walkable(grid, *cell):
                paths[cell] = paths[(x, y)] + [name]
                queue.append(cell)
    return paths


def _teleported(grid: Grid, src: tuple[int, int], dst: tuple[int, int]) -> Grid:
    twin = grid.copy()
    if src != dst:
        twin.put(*dst, twin.cells[src[1] * twin.width + src[0]].pop())
    return twin


def _distance(a: tuple[int, int], b: tuple[int, int]) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def estimate(grid: Grid) -> int:
    """Rough moves left: to the nearest WIN object if one exists; otherwise to bring a noun
    block (of an object on the map) into the free noun slot of an ``IS WIN`` line, plus the walks
    to that noun and from the slot to such an object (so forming the rule does not make the
    estimate jump). Only guides the search order; not a bound."""
    yous = [(x, y) for x, y, _ in grid.you_things()]
    if not yous:
        return 10_000
    tops = list(grid.tops())
    wins = [(x, y) for x, y, t in tops if grid.rules.has(t, "win")]
    if wins:
        return min(_distance(a, b) for a in yous for b in wins)
    objects: dict[str, list[tuple[int, int]]] = {}
    for x, y, t in tops:
        if t.kind == "object":
            objects.setdefault(t.name, []).append((x, y))
    nouns = [((x, y), objects[t.name]) for x, y, t in tops
             if t.kind == "noun" and t.name in objects]
    best = 10_000
    for x, y, thing in tops:
        for dx, dy in ((1, 0), (0, 1)):
            after = (x + dx, y + dy)
            if (thing.kind != "is" or not grid.inside(*after)
                    or getattr(grid.top(*after), "name", None) != "win"):
                continue
            slot = (x - dx, y - dy)
            for noun, targets in nouns:
                best = min(best, 2 * _distance(noun, slot)
                           + min(_distance(noun, you) for you in yous)
                           + min(_distance(slot, target) for target in targets))
    return best


def solve(grid: Grid, max_steps: int = 100, max_nodes: int = 200_000) -> list[str] | None:
    """A short winning action list (within ``max_steps``), or None: best-first on cost plus
    :func:`estimate`, the cost being the number of primitive actions."""
    tie = itertools.count()
    heap: list = [(0, next(tie), 0, grid, [], False)]
    seen = set()
    while heap and len(seen) < max_nodes:
        _, _, cost, node, plan, won = heapq.heappop(heap)
        if won:
            return plan
        yous = node.you_things()
        if len(yous) == 1:
            x, y, _ = yous[0]
            paths = _region(node, (x, y))
            contents = list(node.state_key())
            contents[y * node.width + x] = contents[y * node.width + x][:-1]
            key = (tuple(contents), min(paths))
        else:
            paths = {(x, y): [] for x, y, _ in yous[:1]} if yous else {}
            key = node.state_key()
        if key in seen:
            continue
        seen.add(key)
        starts = paths.items() if len(yous) == 1 else [(None, [])]
        for cell, path in starts:
            for name, (dx, dy) in DIRECTIONS.items():
                if cell is not None:
                    target = (cell[0] + dx, cell[1] + dy)
                    if target in paths or not node.inside(*target):
                        continue  # free walking is inside the node
                    there = node.top(*target)
                    if node.blocks(there) and not node.pushable(there):
                        continue  # a bump: changes nothing
                    child = _teleported(node, (x, y), cell)
                else:
                    child = node.copy()
                steps = cost + len(path) + 1
                if steps > max_steps:
                    continue
                result = child.step(name)
                if result.lost:
                    continue
                priority = steps + (0 if result.won else WEIGHT * estimate(child))
                heapq.heappush(heap, (priority, next(tie), steps, child, plan + path + [name],
                                      result.won))
    return None
