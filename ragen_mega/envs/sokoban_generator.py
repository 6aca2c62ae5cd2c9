"""Seeded Sokoban level generator that only makes solvable levels.

gym-sokoban's idea, written afresh because that package ignores seeds and breaks on numpy 2:

1. a random walk carves the floor of a walled room;
2. targets are placed on the floor with a box on each (a solved position) and a player;
3. the player plays *backwards* from there: every reverse move either walks or walks while
   pulling the box behind it. Each reverse move has a forward inverse (walk back / push), so the
   scrambled position can always be solved by replaying the walk in reverse.

The backwards search visits every position within ``search_depth`` reverse moves (breadth
first, capped at ``_MAX_STATES``) and keeps the one with the highest gym-sokoban score: box swaps
x total box distance from the start targets, among positions with every box off a target.
Randomness comes only from the ``numpy.random.Generator`` passed in, so the same seed gives the
same level in every process.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: (row, col) steps for Up, Down, Left, Right
DIRECTIONS: dict[str, tuple[int, int]] = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1),
                                          "Right": (0, 1)}
_STEPS = list(DIRECTIONS.values())
#: share of the room's inside that the random walk turns into floor
_FLOOR_FRACTION = 0.75
_MAX_TRIES = 100
#: cap on positions the backwards search visits (bounds the time in big rooms with many boxes)
_MAX_STATES = 20_000


@dataclass
class Level:
    """One Sokoban position: fixed walls and targets, moving boxes and player."""

    walls: np.ndarray    # bool [rows, cols]
    targets: np.ndarray  # bool [rows, cols]
    boxes: np.ndarray    # bool [rows, cols]
    player: tuple[int, int]


def max_boxes(dim_room: tuple[int, int]) -> int:
    """Most boxes a room of this size takes: each needs room to be pulled around."""
    return (dim_room[0] - 2) * (dim_room[1] - 2) // 4


def generate_level(rng: np.random.Generator, dim_room: tuple[int, int], num_boxes: int,
                   search_depth: int) -> Level:
    """A scrambled, solvable level; ``search_depth`` reverse moves are played from the solution."""
    for _ in range(_MAX_TRIES):
        floor = _carve_floor(rng, dim_room)
        cells = np.argwhere(floor)  # row-major order: deterministic
        picks = rng.choice(len(cells), size=num_boxes + 1, replace=False)
        targets = np.zeros(dim_room, dtype=bool)
        for r, c in cells[picks[:-1]]:
            targets[r, c] = True
        solved = Level(walls=~floor, targets=targets, boxes=targets.copy(),
                       player=tuple(int(v) for v in cells[picks[-1]]))
        level = _reverse_play(rng, solved, search_depth)
        if level is not None:
            return level
    raise RuntimeError(f"no Sokoban level with dim_room={dim_room}, num_boxes={num_boxes}, "
                       f"search_depth={search_depth} after {_MAX_TRIES} tries; "
                       f"use a larger room, fewer boxes or a larger search_depth")


def _carve_floor(rng: np.random.Generator, dim_room: tuple[int, int]) -> np.ndarray:
    """Random walk inside the border walls, sometimes widening its trail, until enough floor."""
    rows, cols = dim_room
    floor = np.zeros(dim_room, dtype=bool)
    want = int(round(_FLOOR_FRACTION * (rows - 2) * (cols - 2)))
    r, c = int(rng.integers(1, rows - 1)), int(rng.integers(1, cols - 1))
    floor[r, c] = True
    step = _STEPS[int(rng.integers(4))]
    while floor.sum() < want:
        if rng.random() < 0.35:
            step = _STEPS[int(rng.integers(4))]
        nr, nc = r + step[0], c + step[1]
        if not (1 <= nr < rows - 1 and 1 <= nc < cols - 1):
            step = _STEPS[int(rng.integers(4))]
            continue
        r, c = nr, nc
        floor[r, c] = True
        if rng.random() < 0.5:  # widen: open the cell beside the trail
            wr, wc = r + step[1], c + step[0]
            if 1 <= wr < rows - 1 and 1 <= wc < cols - 1:
                floor[wr, wc] = True
    return floor


def _reverse_play(rng: np.random.Generator, solved: Level, depth: int) -> Level | None:
    """The best-scoring position within ``depth`` reverse moves of ``solved`` (module
    docstring), or None if no position has every box off the targets."""
    walls = solved.walls
    origin = tuple(tuple(int(v) for v in rc) for rc in np.argwhere(solved.boxes))
    # state: (player, boxes as a tuple in the order of ``origin``); value: (swaps, last pulled)
    start = (solved.player, origin)
    seen = {start: (0, -1)}
    frontier = [start]
    best, best_score = None, 0
    for _ in range(depth):
        next_frontier = []
        for state in frontier:
            player, boxes = state
            swaps, last = seen[state]
            for move in rng.permutation(8):  # 0-3: walk and pull the box behind, 4-7: walk
                dr, dc = _STEPS[move % 4]
                nxt = (player[0] + dr, player[1] + dc)
                if walls[nxt] or nxt in boxes:
                    continue
                behind = (player[0] - dr, player[1] - dc)
                new_boxes, new_swaps, new_last = boxes, swaps, last
                if move < 4 and behind in boxes:
                    i = boxes.index(behind)
                    new_boxes = boxes[:i] + (player,) + boxes[i + 1:]
                    if i != last:
                        new_swaps, new_last = swaps + 1, i
                new = (nxt, new_boxes)
                if new in seen:
                    continue
                seen[new] = (new_swaps, new_last)
                next_frontier.append(new)
                if not any(solved.targets[b] for b in new_boxes):
                    distance = sum(abs(b[0] - o[0]) + abs(b[1] - o[1])
                                   for b, o in zip(new_boxes, origin))
                    if new_swaps * distance > best_score:
                        best, best_score = new, new_swaps * distance
                if len(seen) >= _MAX_STATES:
                    return _to_level(solved, best)
        frontier = next_frontier
        if not frontier:
            break
    return _to_level(solved, best)


def _to_level(solved: Level, state) -> Level | None:
    if state is None:
        return None
    player, boxes = state
    box_grid = np.zeros_like(solved.boxes)
    for r, c in boxes:
        box_grid[r, c] = True
    return Level(walls=solved.walls.copy(), targets=solved.targets.copy(), boxes=box_grid,
                 player=player)
