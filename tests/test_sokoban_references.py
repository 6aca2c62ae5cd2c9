"""Sokoban's exact reference lines: hand-worked levels, and the search against the real env."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from ragen_mega.envs.references import reference_lines
from ragen_mega.envs.sokoban import SokobanEnv
from ragen_mega.envs.sokoban_generator import DIRECTIONS
from ragen_mega.envs.sokoban_references import (Board, best_fixed, fixed_answer, optimal,
                                                random_valid)

# the player, a floor cell, a box, its target: Right, Right solves it
CORRIDOR = "######\n#P_XO#\n######"


def test_corridor_by_hand():
    """From the start only Right moves (Up, Down, Left hit walls); one cell on, Right solves,
    Left goes back, Up and Down stay. Within 2 random moves: (1/4)^2; within 3: RR (1/16), then
    xRR with x a wall-bump (3/64), Rx'R with x' Up or Down (2/64): 9/64."""
    board = Board.from_grid(CORRIDOR)
    assert random_valid(board, max_turns=1, max_actions_per_turn=2) == pytest.approx(1 / 16)
    assert random_valid(board, max_turns=1, max_actions_per_turn=3) == pytest.approx(9 / 64)
    assert random_valid(board, max_turns=3, max_actions_per_turn=1) == pytest.approx(9 / 64)
    assert optimal(board, max_turns=1, max_actions_per_turn=1) == 0.0  # one move is too few
    assert optimal(board, max_turns=2, max_actions_per_turn=1) == 1.0
    assert optimal(board, max_turns=1, max_actions_per_turn=2) == 1.0
    assert best_fixed(board, max_turns=2, max_actions_per_turn=1) == 1.0   # Right, twice
    assert fixed_answer(board, ["Up", "Down"], max_turns=5, max_actions_per_turn=2) == 0.0
    assert fixed_answer(board, ["Right", "Left"], max_turns=5, max_actions_per_turn=2) == 0.0
    assert fixed_answer(board, ["Up", "Right"], max_turns=2, max_actions_per_turn=2) == 1.0
    assert fixed_answer(board, ["Up", "Right"], max_turns=1, max_actions_per_turn=2) == 0.0
    # the env stops after max_steps moves, whatever the turns allow
    short = Board.from_grid(CORRIDOR, max_steps=1)
    assert optimal(short, 5, 3) == 0.0 and random_valid(short, 5, 3) == 0.0
    assert fixed_answer(short, ["Right"], 5, 3) == 0.0


def test_a_box_pushed_to_the_wall_is_lost_for_good():
    """Right then Down pushes the box straight onto its target below. Down then Right pushes it
    against the right wall instead: from there it can only go up or down that wall, into a
    corner, so no number of moves solves the level."""
    board = Board.from_grid("#####\n#P__#\n#_X_#\n#_O_#\n#####")
    assert optimal(board, max_turns=1, max_actions_per_turn=2) == 1.0
    assert fixed_answer(board, ["Right", "Down"], 1, 2) == 1.0
    lost = board.move(board.move(board.start, "Down"), "Right")
    assert lost == ((2, 2), frozenset({(2, 3)}))
    stuck = Board(board.walls, board.targets, board.rows, board.cols, lost, 100)
    assert optimal(stuck, max_turns=50, max_actions_per_turn=5) == 0.0
    assert random_valid(stuck, max_turns=10, max_actions_per_turn=3) == 0.0


def play_env(env, seed, answer, max_turns, k):
    env.reset(seed)
    for _ in range(max_turns):
        for word in list(answer)[:k]:
            _, _, done, info = env.step(word)
            if done:
                return float(info["success"])
    return 0.0


@pytest.mark.parametrize("kwargs", [{}, {"max_steps": 7}, {"dim_room": [7, 7], "num_boxes": 2}])
def test_fixed_answers_equal_the_real_env_played_out(kwargs):
    """Every answer of 1..2 moves, written 4 turns of 2, on 3 levels: the search's outcome is the
    real env's, move for move (max_steps included)."""
    env = SokobanEnv(**kwargs)
    for seed in range(3):
        env.reset(seed)
        board = Board.from_grid(env.render(), env.max_steps)
        for k in (1, 2):
            for answer in itertools.product(DIRECTIONS, repeat=k):
                assert fixed_answer(board, answer, 4, 2) == play_env(env, seed, answer, 4, 2), \
                    (seed, answer)


def test_random_valid_against_the_real_env_by_sampling():
    """2,000 seeded random walks of 5 turns x 3 moves on each of 4 levels: the solved share is
    within 4 standard errors of the exact line (binomial), on every level."""
    env, rng = SokobanEnv(), np.random.default_rng(0)
    words = list(DIRECTIONS)
    for seed in range(4):
        env.reset(seed)
        exact = random_valid(Board.from_grid(env.render(), env.max_steps), 5, 3)
        wins = sum(play_env(env, seed, rng.choice(words, size=15), 1, 15) for _ in range(2000))
        stderr = max((exact * (1 - exact) / 2000) ** 0.5, 1e-3)
        assert abs(wins / 2000 - exact) < 4 * stderr, (seed, wins / 2000, exact)


def test_lines_are_ordered_and_averaged_over_seeds():
    seeds = [0, 1, 2, 3, 1]  # a seed listed twice counts twice
    lines = reference_lines("sokoban", {}, seeds, max_turns=5, max_actions_per_turn=3,
                            example_answer=["Up", "Down"])
    assert list(lines) == ["random_valid", "example_copy", "best_fixed", "optimal"]
    assert lines["random_valid"] <= lines["optimal"]
    assert lines["example_copy"] <= lines["best_fixed"] <= lines["optimal"]
    one = [reference_lines("sokoban", {}, [s], max_turns=5, max_actions_per_turn=3,
                           example_answer=["Up", "Down"]) for s in seeds]
    for key in lines:
        assert lines[key] == pytest.approx(np.mean([o[key] for o in one]))
