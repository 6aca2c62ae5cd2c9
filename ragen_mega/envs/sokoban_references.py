"""Reference success rates for Sokoban, exact, by search over the level's positions.

A position is the player's cell and the set of box cells; walls and targets never move. Moves
follow the env's rule (:func:`~ragen_mega.envs.sokoban.move_outcome`): a blocked move changes
nothing and still counts. Play is the rollout's (``frozen_lake_references.py``): up to
``max_turns`` turns of up to ``K = max_actions_per_turn`` moves, stepped blind until solved,
at most ``N = min(max_turns * K, max_steps)`` moves. Success = every box on a target.

Lines, each a probability for one level:

- :func:`random_valid`: every move a uniformly random action word, a Markov chain over
  positions (the solved position absorbing), N moves;
- :func:`fixed_answer` / :func:`best_fixed`: one answer (1..K moves) written every turn; the
  best over all 4 + ... + 4**K answers (``example_copy`` is the prompt's example answer);
- :func:`optimal`: the level can be solved in N moves or fewer (breadth-first search). The env
  is deterministic and fully seen, so this is the per-turn optimum too.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from ragen_mega.envs.sokoban import SokobanEnv, move_outcome, parse_grid
from ragen_mega.envs.sokoban_generator import DIRECTIONS

Cell = tuple[int, int]
Position = tuple[Cell, frozenset]  # (player, boxes)


@dataclass(frozen=True)
class Board:
    """A level's fixed part and its start position."""

    walls: frozenset
    targets: frozenset
    rows: int
    cols: int
    start: Position
    max_steps: int

    @classmethod
    def from_grid(cls, grid: str, max_steps: int = 100) -> "Board":
        """From a grid in the env's symbols (``SokobanEnv.render()``)."""
        level = parse_grid(grid)
        rows, cols = level.walls.shape
        return cls(_cells(level.walls), _cells(level.targets), rows, cols,
                   (tuple(level.player), _cells(level.boxes)), max_steps)

    def blocked(self, cell: Cell) -> bool:
        return not (0 <= cell[0] < self.rows and 0 <= cell[1] < self.cols) or cell in self.walls

    def move(self, position: Position, word: str) -> Position:
        player, boxes = position
        outcome = move_outcome(player, DIRECTIONS[word], self.blocked, boxes.__contains__)
        if outcome is None:
            return position
        player, push = outcome
        if push is not None:
            boxes = boxes - {push[0]} | {push[1]}
        return player, boxes

    def solved(self, position: Position) -> bool:
        return position[1] <= self.targets


def _cells(mask) -> frozenset:
    return frozenset((int(r), int(c)) for r, c in zip(*mask.nonzero()))


def horizon(board: Board, max_turns: int, max_actions_per_turn: int) -> int:
    """N: the moves an episode can make."""
    return min(max_turns * max_actions_per_turn, board.max_steps)


def random_valid(board: Board, max_turns: int, max_actions_per_turn: int) -> float:
    """P(solved within N uniformly random moves)."""
    words = list(DIRECTIONS)
    dist, won = {board.start: 1.0}, 0.0
    if board.solved(board.start):
        return 1.0
    for _ in range(horizon(board, max_turns, max_actions_per_turn)):
        nxt: dict[Position, float] = {}
        for position, p in dist.items():
            for word in words:
                after = board.move(position, word)
                if board.solved(after):
                    won += p / len(words)
                else:
                    nxt[after] = nxt.get(after, 0.0) + p / len(words)
        dist = nxt
    return won


def fixed_answer(board: Board, answer: Sequence[str], max_turns: int,
                 max_actions_per_turn: int) -> float:
    """1.0 if writing ``answer`` (its first K moves) every turn solves the level, else 0.0."""
    moves = list(answer)[:max_actions_per_turn]
    position, left = board.start, board.max_steps
    for _ in range(max_turns):
        for word in moves:
            if board.solved(position) or left == 0:
                break
            position, left = board.move(position, word), left - 1
    return float(board.solved(position))


def best_fixed(board: Board, max_turns: int, max_actions_per_turn: int) -> float:
    """The best :func:`fixed_answer` over every answer of 1..K moves."""
    return max(fixed_answer(board, answer, max_turns, max_actions_per_turn)
               for k in range(1, max_actions_per_turn + 1)
               for answer in itertools.product(DIRECTIONS, repeat=k))


def optimal(board: Board, max_turns: int, max_actions_per_turn: int) -> float:
    """1.0 if some sequence of at most N moves solves the level (breadth-first), else 0.0."""
    frontier, seen = [board.start], {board.start}
    for _ in range(horizon(board, max_turns, max_actions_per_turn) + 1):
        if any(board.solved(p) for p in frontier):
            return 1.0
        nxt = []
        for position in frontier:
            for word in DIRECTIONS:
                after = board.move(position, word)
                if after not in seen:
                    seen.add(after)
                    nxt.append(after)
        frontier = nxt
    return 0.0


def references(env_kwargs: dict, seed: int, max_turns: int, max_actions_per_turn: int,
               example_answer: Sequence[str] | None) -> dict[str, float]:
    """The lines of the level ``SokobanEnv(**env_kwargs)`` plays on ``seed``."""
    env = SokobanEnv(**env_kwargs)
    env.reset(seed)
    board = Board.from_grid(env.render(), env.max_steps)
    lines = {"random_valid": random_valid(board, max_turns, max_actions_per_turn),
             "best_fixed": best_fixed(board, max_turns, max_actions_per_turn),
             "optimal": optimal(board, max_turns, max_actions_per_turn)}
    if example_answer is not None:
        lines["example_copy"] = fixed_answer(board, example_answer, max_turns,
                                             max_actions_per_turn)
    return lines
