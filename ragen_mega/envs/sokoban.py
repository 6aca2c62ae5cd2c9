"""Sokoban as a text game, with gym-sokoban's rewards and RAGEN's grid symbols.

Levels come from :mod:`ragen_mega.envs.sokoban_generator` (seeded reverse play, so every level is
solvable). Rewards follow gym-sokoban, which RAGEN trains on: ``move_reward`` (default -0.1) per
move, +1 when a push puts a box on a target, -1 when a push takes one off, +10 when every box is
on a target, each bonus on top of the move's ``move_reward`` (the solving push pays
``move_reward + 1 + 10``).

A move into a wall, or a push against a wall or another box, is a valid action that changes
nothing (``action_is_effective`` False) and still pays ``move_reward``. The episode ends when
solved or after ``max_steps`` valid moves; ``step`` after that raises.

Why ``move_reward`` is a kwarg: an invalid turn's penalty comes not from this env (it pays 0) but
from the rollout, which adds ``agent.format_penalty`` (RAGEN: -0.1) once to a turn that breaks
the format or holds an unknown action (:func:`ragen_mega.rollout.episode.take_turn`). With the
defaults a move costs -0.1 too, so an episode that will not be solved scores no worse with
invalid turns than by moving (and better than with turns of several moves): moving does not pay
for a loser. RAGEN has the same trap; the default keeps RAGEN's -0.1. ``move_reward=0`` or
``-0.01`` makes a move cheaper than an invalid turn. The value is *added* to each valid move's
reward, so a cost is negative.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ragen_mega.envs.base import TextEnv, invalid_action_info
from ragen_mega.envs.checks import check_seed, ensure_steppable, is_int, is_real
from ragen_mega.envs.text_actions import match_action, normalize_action, unknown_action_reason
from ragen_mega.envs.sokoban_generator import DIRECTIONS, Level, generate_level, max_boxes

MOVE_REWARD = -0.1  # gym-sokoban's and RAGEN's per-move reward (a cost)
BOX_ON_TARGET = 1.0
BOX_OFF_TARGET = -1.0
FINISHED = 10.0

WALL, FLOOR, TARGET, BOX, BOX_ON, PLAYER, PLAYER_ON = "#", "_", "O", "X", "√", "P", "S"
LEGEND = {WALL: "wall", FLOOR: "empty", TARGET: "target", BOX: "box", BOX_ON: "box on target",
          PLAYER: "player", PLAYER_ON: "player on target"}
_ACTION_KEYS = [normalize_action(word) for word in DIRECTIONS]


class SokobanEnv(TextEnv):
    """Push every box (X) onto a target (O); see the module docstring for rules and rewards."""

    def __init__(self, dim_room: tuple[int, int] = (6, 6), num_boxes: int = 1,
                 max_steps: int = 100, search_depth: int = 100,
                 move_reward: float = MOVE_REWARD):
        """``search_depth``: reverse moves from the solved position the generator plays when
        scrambling a level (smaller: boxes stay closer to their targets). ``move_reward``: added
        for every valid move, blocked ones included (module docstring)."""
        if (not isinstance(dim_room, (tuple, list)) or len(dim_room) != 2
                or not all(is_int(v) and v >= 5 for v in dim_room)):
            raise ValueError(f"sokoban: dim_room must be two ints >= 5 (rows, cols), "
                             f"got {dim_room!r}")
        self.dim_room = (int(dim_room[0]), int(dim_room[1]))
        if not is_int(num_boxes) or not 1 <= num_boxes <= max_boxes(self.dim_room):
            raise ValueError(f"sokoban: num_boxes must be an int in 1..{max_boxes(self.dim_room)} "
                             f"for dim_room={self.dim_room}, got {num_boxes!r}")
        if not is_int(max_steps) or max_steps < 1:
            raise ValueError(f"sokoban: max_steps must be an int >= 1, got {max_steps!r}")
        if not is_int(search_depth) or search_depth < 1:
            raise ValueError(f"sokoban: search_depth must be an int >= 1, got {search_depth!r}")
        if not is_real(move_reward):
            raise ValueError(f"sokoban: move_reward must be a finite number (the reward added per "
                             f"valid move, default {MOVE_REWARD}), got {move_reward!r}")
        self.num_boxes, self.max_steps, self.search_depth = num_boxes, max_steps, search_depth
        self.move_reward = float(move_reward)
        self._level: Level | None = None
        self._steps = 0
        self._on_target = 0
        self._done = False

    @property
    def instruction(self) -> str:
        legend = ", ".join(f"{sym} {name}" for sym, name in LEGEND.items())
        return ("You are solving the Sokoban puzzle. You are the player and you need to push all "
                "boxes onto targets. When you stand right next to a box you push it by moving "
                "in its direction. You cannot push a box into a wall or into another box, and "
                "you cannot pull a box.\n"
                f"The grid has one row per line. Symbols: {legend}.\n"
                "Actions: Up, Down, Left, Right (one move each; case does not matter).\n"
                f"Rewards: {self.move_reward:g} per move, +1 for a box pushed onto a target, "
                "-1 for a box pushed off a target, +10 when all boxes are on targets.")

    @property
    def valid_actions(self) -> list[str]:
        return list(DIRECTIONS)

    def reset(self, seed: int) -> str:
        rng = np.random.default_rng(check_seed("sokoban", seed))
        return self._start(generate_level(rng, self.dim_room, self.num_boxes, self.search_depth))

    def load_level(self, grid: str) -> str:
        """Start an episode from a grid written in this env's symbols (hand-made levels)."""
        return self._start(parse_grid(grid))

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        ensure_steppable("sokoban", self._level is not None, self._done)
        index = match_action(action, _ACTION_KEYS)
        if index is None:
            return self.render(), 0.0, False, invalid_action_info(
                unknown_action_reason(action, self.valid_actions))
        self._steps += 1
        moved = self._move(list(DIRECTIONS.values())[index])
        level = self._level
        on_target = int((level.boxes & level.targets).sum())
        reward = self.move_reward
        if on_target > self._on_target:
            reward += BOX_ON_TARGET
        elif on_target < self._on_target:
            reward += BOX_OFF_TARGET
        self._on_target = on_target
        solved = on_target == int(level.boxes.sum())
        if solved:
            reward += FINISHED
        self._done = solved or self._steps >= self.max_steps
        info = {"action_is_valid": True, "action_is_effective": moved, "success": solved,
                "boxes_on_target": on_target}
        return self.render(), reward, self._done, info

    def render(self) -> str:
        """The grid as text, one row per line, in RAGEN's symbols."""
        if self._level is None:
            raise RuntimeError("env 'sokoban': call reset(seed) before render()")
        level = self._level
        grid = np.full(level.walls.shape, FLOOR, dtype=object)
        grid[level.walls] = WALL
        grid[level.targets] = TARGET
        grid[level.boxes] = BOX
        grid[level.boxes & level.targets] = BOX_ON
        grid[level.player] = PLAYER_ON if level.targets[level.player] else PLAYER
        return "\n".join("".join(row) for row in grid)

    def _start(self, level: Level) -> str:
        self._level = level
        self._steps, self._done = 0, False
        self._on_target = int((level.boxes & level.targets).sum())
        return self.render()

    def _move(self, step: tuple[int, int]) -> bool:
        """Move the player one cell, pushing a box if one is there; False if blocked."""
        level = self._level
        outcome = move_outcome(level.player, step, lambda cell: _blocked(level, cell),
                               lambda cell: bool(level.boxes[cell]))
        if outcome is None:
            return False
        level.player, push = outcome
        if push is not None:
            level.boxes[push[0]], level.boxes[push[1]] = False, True
        return True


Cell = tuple[int, int]


def move_outcome(player: Cell, step: Cell, blocked: Callable[[Cell], bool],
                 has_box: Callable[[Cell], bool]) -> tuple[Cell, tuple[Cell, Cell] | None] | None:
    """Sokoban's rule for one move, on any representation of a position: the player's new cell
    and its push (a box's cell and where it goes, or None), or None when blocked (a wall ahead,
    or a box held by a wall or another box). The env and ``sokoban_references.py`` both use it."""
    nxt = (player[0] + step[0], player[1] + step[1])
    if blocked(nxt):
        return None
    if not has_box(nxt):
        return nxt, None
    beyond = (nxt[0] + step[0], nxt[1] + step[1])
    if blocked(beyond) or has_box(beyond):
        return None
    return nxt, (nxt, beyond)


def parse_grid(grid: str) -> Level:
    """Read a grid written in the env's symbols; errors name the offending row or symbol."""
    rows = grid.strip("\n").split("\n")
    if not rows or any(len(row) != len(rows[0]) for row in rows):
        raise ValueError(f"sokoban grid: rows must all have the same length, got {grid!r}")
    unknown = sorted(set("".join(rows)) - set(LEGEND))
    if unknown:
        raise ValueError(f"sokoban grid: unknown symbol(s) {unknown}; legend: {LEGEND}")
    chars = np.array([list(row) for row in rows])
    players = np.argwhere(np.isin(chars, [PLAYER, PLAYER_ON]))
    if len(players) != 1:
        raise ValueError(f"sokoban grid: need exactly one player (P or S), found {len(players)}")
    boxes = np.isin(chars, [BOX, BOX_ON])
    targets = np.isin(chars, [TARGET, BOX_ON, PLAYER_ON])
    if boxes.sum() == 0 or boxes.sum() != targets.sum():
        raise ValueError(f"sokoban grid: need as many boxes as targets (at least one), found "
                         f"{int(boxes.sum())} boxes and {int(targets.sum())} targets")
    return Level(walls=chars == WALL, targets=targets, boxes=boxes,
                 player=(int(players[0][0]), int(players[0][1])))


def _blocked(level: Level, cell: tuple[int, int]) -> bool:
    rows, cols = level.walls.shape
    return not (0 <= cell[0] < rows and 0 <= cell[1] < cols) or bool(level.walls[cell])
