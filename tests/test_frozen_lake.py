"""FrozenLake: dynamics equal gymnasium's own FrozenLake-v1 (same map, seed and actions), the
slip probability is RAGEN's 0.8, and the text grid matches gymnasium's map."""
from __future__ import annotations

from collections import deque

import gymnasium
import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from ragen_mega.envs import make

GYM_ACTION = {"Left": 0, "Down": 1, "Right": 2, "Up": 3}  # gymnasium's documented action ids
STEP = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}


def player_cell(text: str) -> tuple[tuple[int, int], str]:
    """(row, col) and symbol of the player in the text grid (P, X in a hole, √ on the goal)."""
    found = [((r, c), ch) for r, row in enumerate(text.split("\n"))
             for c, ch in enumerate(row) if ch in "PX√"]
    assert len(found) == 1, text
    return found[0]


@pytest.mark.parametrize("size,is_slippery,success_rate", [
    (4, True, 0.8), (6, True, 0.8), (5, True, 1 / 3), (4, False, 0.8)])
def test_dynamics_equal_gymnasium(size, is_slippery, success_rate):
    env = make("frozen_lake", size=size, is_slippery=is_slippery, success_rate=success_rate)
    for seed in range(25):
        ref = gymnasium.make("FrozenLake-v1", desc=generate_random_map(size, 0.8, seed=seed),
                             is_slippery=is_slippery, success_rate=success_rate)
        state, _ = ref.reset(seed=seed)
        text = env.reset(seed)
        actions = np.random.default_rng(1000 + seed).choice(list(GYM_ACTION), size=40)
        for action in actions:
            state, ref_reward, terminated, truncated, _ = ref.step(GYM_ACTION[action])
            text, reward, done, info = env.step(str(action))
            assert player_cell(text)[0] == divmod(int(state), size), f"seed {seed}"
            assert (reward, done) == (ref_reward, terminated or truncated)
            assert info["success"] == (ref_reward == 1.0)
            if done:
                break


def test_time_limit_matches_gymnasium():
    """On a lake without holes, walking into the corner never ends the game: both stop at 100."""
    env = make("frozen_lake", p=1.0)
    ref = gymnasium.make("FrozenLake-v1", desc=generate_random_map(4, 1.0, seed=3),
                         is_slippery=True, success_rate=0.8)
    ref.reset(seed=3)
    env.reset(3)
    for step in range(1, 101):
        _, _, terminated, truncated, _ = ref.step(GYM_ACTION["Up"])
        _, reward, done, info = env.step("Up")  # slips go Left/Right; Up/Left/Right never reach G
        assert done == (terminated or truncated) == (step == 100)
    assert reward == 0.0 and not info["success"]
    with pytest.raises(RuntimeError, match="done"):
        env.step("Up")


@pytest.mark.parametrize("success_rate", [0.8, 0.5])
def test_slip_probabilities(success_rate):
    """From the top-left corner of an all-ice lake, Down goes down with ``success_rate``, else
    left (blocked by the edge: stays) or right, each with (1 - success_rate) / 2."""
    env = make("frozen_lake", size=5, p=1.0, success_rate=success_rate)
    n = 3000
    counts = {(1, 0): 0, (0, 0): 0, (0, 1): 0}
    for seed in range(n):
        env.reset(seed)
        counts[player_cell(env.step("Down")[0])[0]] += 1
    for cell, prob in [((1, 0), success_rate), ((0, 0), (1 - success_rate) / 2),
                       ((0, 1), (1 - success_rate) / 2)]:
        sigma = (n * prob * (1 - prob)) ** 0.5
        assert abs(counts[cell] - n * prob) < 4.5 * sigma, (cell, counts)


def test_text_grid_matches_gymnasium_map():
    symbol = {"F": "_", "H": "O", "G": "G", "S": "_"}  # RAGEN's FrozenLake vocabulary
    for size in (3, 4, 7):
        env = make("frozen_lake", size=size, p=0.7)
        for seed in range(20):
            desc = generate_random_map(size, 0.7, seed=seed)
            expected = [[symbol[ch] for ch in row] for row in desc]
            expected[0][0] = "P"
            assert env.reset(seed) == "\n".join("".join(row) for row in expected)


def _path(desc: list[str], start, goal_letters: str) -> list[str]:
    """BFS over ice (non-slippery moves) to a cell whose letter is in ``goal_letters``."""
    n = len(desc)
    parent = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if desc[cell[0]][cell[1]] in goal_letters:
            plan = []
            while parent[cell] is not None:
                cell, move = parent[cell]
                plan.append(move)
            return plan[::-1]
        if desc[cell[0]][cell[1]] in "HG":
            continue
        for move, (dr, dc) in STEP.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= nxt[0] < n and 0 <= nxt[1] < n and nxt not in parent:
                parent[nxt] = (cell, move)
                queue.append(nxt)
    return []


def test_goal_and_hole_symbols_and_rewards():
    env = make("frozen_lake", size=5, p=0.7, is_slippery=False)
    seen_hole = False
    for seed in range(10):
        desc = generate_random_map(5, 0.7, seed=seed)
        for letters, reward, symbol in [("G", 1.0, "√"), ("H", 0.0, "X")]:
            plan = _path(desc, (0, 0), letters)
            if not plan:
                continue
            seen_hole |= letters == "H"
            env.reset(seed)
            for i, move in enumerate(plan):
                text, r, done, info = env.step(move.lower())
                assert done == (i == len(plan) - 1)
            assert (r, info["success"]) == (reward, letters == "G")
            assert player_cell(text)[1] == symbol
    assert seen_hole


def test_invalid_actions_and_bad_kwargs():
    env = make("frozen_lake")
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Left")
    text = env.reset(11)
    for garbage in ["", "west", "Left Left", None, "x" * 100_000, "⬅️"]:
        obs, reward, done, info = env.step(garbage)
        assert (obs, reward, done, info["action_is_valid"]) == (text, 0.0, False, False)
    for kwargs, name in [({"size": 1}, "size"), ({"p": 0}, "p"), ({"p": 1.5}, "p"),
                         ({"is_slippery": "yes"}, "is_slippery"),
                         ({"success_rate": -0.1}, "success_rate"), ({"max_steps": 0}, "max_steps")]:
        with pytest.raises(ValueError, match=name):
            make("frozen_lake", **kwargs)
