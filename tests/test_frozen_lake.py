"""FrozenLake: dynamics equal gymnasium's own FrozenLake-v1 (same map, seed and actions), the
slip probability is RAGEN's 0.8, and the text grid matches gymnasium's map. Maps: RAGEN's random
start and goal by default (always a path, positions spread as RAGEN's generator spreads them, the
same in any process), gymnasium's corner layout with ``start_goal="corners"``."""
from __future__ import annotations

from collections import deque

import json
import os
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("start_goal", ["random", "corners"])
@pytest.mark.parametrize("size,is_slippery,success_rate", [
    (4, True, 0.8), (6, True, 0.8), (5, True, 1 / 3), (4, False, 0.8)])
def test_dynamics_equal_gymnasium(size, is_slippery, success_rate, start_goal):
    """gymnasium's FrozenLake-v1 on the env's map (for corners: gymnasium's own random map)."""
    env = make("frozen_lake", size=size, is_slippery=is_slippery, success_rate=success_rate,
               start_goal=start_goal)
    for seed in range(25):
        text = env.reset(seed)
        desc = (generate_random_map(size, 0.8, seed=seed) if start_goal == "corners"
                else env.map_rows)
        ref = gymnasium.make("FrozenLake-v1", desc=desc,
                             is_slippery=is_slippery, success_rate=success_rate)
        state, _ = ref.reset(seed=seed)
        assert player_cell(text)[0] == divmod(int(state), size)
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
    """On a lake without holes, walking into the corner never ends the game: both stop at 100.
    (Corner layout: the goal must be at the bottom-right for Up/Left/Right never to reach it.)"""
    env = make("frozen_lake", p=1.0, start_goal="corners")
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
    left (blocked by the edge: stays) or right, each with (1 - success_rate) / 2. (Corner
    layout: the test needs the start in the top-left corner.)"""
    env = make("frozen_lake", size=5, p=1.0, success_rate=success_rate, start_goal="corners")
    n = 3000
    counts = {(1, 0): 0, (0, 0): 0, (0, 1): 0}
    for seed in range(n):
        env.reset(seed)
        counts[player_cell(env.step("Down")[0])[0]] += 1
    for cell, prob in [((1, 0), success_rate), ((0, 0), (1 - success_rate) / 2),
                       ((0, 1), (1 - success_rate) / 2)]:
        sigma = (n * prob * (1 - prob)) ** 0.5
        assert abs(counts[cell] - n * prob) < 4.5 * sigma, (cell, counts)


@pytest.mark.parametrize("start_goal", ["random", "corners"])
def test_text_grid_matches_the_map(start_goal):
    symbol = {"F": "_", "H": "O", "G": "G", "S": "_"}  # RAGEN's FrozenLake vocabulary
    for size in (3, 4, 7):
        env = make("frozen_lake", size=size, p=0.7, start_goal=start_goal)
        for seed in range(20):
            text = env.reset(seed)
            desc = env.map_rows
            if start_goal == "corners":
                assert desc == generate_random_map(size, 0.7, seed=seed)
            expected = [[symbol[ch] for ch in row] for row in desc]
            r, c = _find(desc, "S")
            expected[r][c] = "P"
            assert text == "\n".join("".join(row) for row in expected)


def _find(desc: list[str], letter: str) -> tuple[int, int]:
    found = [(r, c) for r, row in enumerate(desc) for c, ch in enumerate(row) if ch == letter]
    assert len(found) == 1, (letter, desc)
    return found[0]


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


@pytest.mark.parametrize("start_goal", ["random", "corners"])
def test_goal_and_hole_symbols_and_rewards(start_goal):
    env = make("frozen_lake", size=5, p=0.7, is_slippery=False, start_goal=start_goal)
    seen_hole = False
    for seed in range(10):
        env.reset(seed)
        desc = env.map_rows
        for letters, reward, symbol in [("G", 1.0, "√"), ("H", 0.0, "X")]:
            plan = _path(desc, _find(desc, "S"), letters)
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
                         ({"success_rate": -0.1}, "success_rate"), ({"max_steps": 0}, "max_steps"),
                         ({"start_goal": "center"}, "start_goal"),
                         ({"start_goal": 1}, "start_goal"),
                         ({"observation_format": "image"}, "observation_format")]:
        with pytest.raises(ValueError, match=name):
            make("frozen_lake", **kwargs)


# --- maps: RAGEN's random start and goal (default), gymnasium's corners -------------------------

def _has_path(desc: list[str]) -> bool:
    """Own flood fill (independent of the env's generator): G reachable from S over non-H."""
    n_rows, n_cols = len(desc), len(desc[0])
    start, goal = _find(desc, "S"), _find(desc, "G")
    seen, stack = {start}, [start]
    while stack:
        r, c = stack.pop()
        for nr, nc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
            if (0 <= nr < n_rows and 0 <= nc < n_cols and (nr, nc) not in seen
                    and desc[nr][nc] != "H"):
                seen.add((nr, nc))
                stack.append((nr, nc))
    return goal in seen


@pytest.mark.parametrize("start_goal", ["random", "corners"])
def test_every_map_has_a_path_from_start_to_goal(start_goal):
    for size, p in [(2, 0.8), (3, 0.5), (4, 0.8), (5, 0.6), (7, 0.8)]:
        env = make("frozen_lake", size=size, p=p, start_goal=start_goal)
        for seed in range(200):
            env.reset(seed)
            desc = env.map_rows
            assert len(desc) == size and all(len(row) == size for row in desc)
            assert set("".join(desc)) <= set("SFHG")
            assert "".join(desc).count("S") == 1 and "".join(desc).count("G") == 1
            assert _has_path(desc), (size, p, seed, desc)


def _start_goal_distances(start_goal: str, n_seeds: int = 500):
    env = make("frozen_lake", size=4, start_goal=start_goal)
    starts, goals, dists = [], [], []
    for seed in range(n_seeds):
        env.reset(seed)
        (sr, sc), (gr, gc) = _find(env.map_rows, "S"), _find(env.map_rows, "G")
        starts.append((sr, sc))
        goals.append((gr, gc))
        dists.append(abs(sr - gr) + abs(sc - gc))
    return starts, goals, np.array(dists)


def test_random_start_and_goal_are_spread_as_in_ragen():
    """Over 500 seeds on 4x4 (p=0.8) start and goal each take all 16 cells (a cell is missed by
    500 uniform draws with probability (15/16)**500 ~ 1e-14), and the start-goal distance has
    the distribution of RAGEN's procedure: uniform distinct start and goal, kept with the
    probability that the random tiles join them. Computed exactly (all 2**16 hole patterns):
    mean Manhattan distance 2.6236, 21.08% at distance 1 (distinct uniform cells without the
    path condition: 2.667 and 20%); the test allows 4 standard errors of a 500-map mean."""
    starts, goals, dists = _start_goal_distances("random")
    assert len(set(starts)) == 16 and len(set(goals)) == 16
    assert dists.min() >= 1 and dists.max() == 6
    se = 1.24 / np.sqrt(len(dists))  # the exact distribution's standard deviation is 1.24
    assert abs(dists.mean() - 2.6236) < 4 * se, dists.mean()
    share = (dists == 1).mean()
    assert abs(share - 0.2108) < 4 * np.sqrt(0.2108 * 0.7892 / len(dists)), share
    _, _, corner_dists = _start_goal_distances("corners", n_seeds=50)
    assert set(corner_dists) == {6}


def test_corners_reproduce_gymnasium_maps():
    for size, p in [(3, 0.8), (4, 0.8), (4, 0.6), (8, 0.8)]:
        env = make("frozen_lake", size=size, p=p, start_goal="corners")
        for seed in range(40):
            env.reset(seed)
            desc = env.map_rows
            assert desc == generate_random_map(size=size, p=p, seed=seed)
            assert desc[0][0] == "S" and desc[-1][-1] == "G"


_MAPS_SCRIPT = """
import json
from ragen_mega.envs import make
out = {}
for layout in ("random", "corners"):
    for size in (3, 4, 6):
        env = make("frozen_lake", size=size, start_goal=layout)
        out[f"{layout}-{size}"] = [(env.reset(seed), env.map_rows) for seed in range(40)]
print(json.dumps(out))
"""


def test_same_seed_same_map_in_another_process():
    """Maps (and first observations) from two fresh processes with different hash seeds equal
    the ones made here."""
    root = Path(__file__).resolve().parent.parent
    here = json.loads(json.dumps({
        f"{layout}-{size}": [(env.reset(seed), env.map_rows) for seed in range(40)]
        for layout in ("random", "corners") for size in (3, 4, 6)
        for env in [make("frozen_lake", size=size, start_goal=layout)]}))
    for hash_seed in ("1", "4242"):
        out = subprocess.run([sys.executable, "-c", _MAPS_SCRIPT], capture_output=True, text=True,
                             timeout=120, cwd=root,
                             env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout) == here
    assert len({tuple(rows) for _, rows in here["random-4"]}) == 40


# --- observation formats (RAGEN's observation_format) ------------------------------------------

def test_coordinate_observations_follow_ragen_format():
    env = make("frozen_lake", size=4, is_slippery=False, observation_format="coord")
    for seed in range(30):
        text = env.reset(seed)
        desc = env.map_rows
        if "H" in "".join(desc):
            break
    holes = [(r, c) for r, row in enumerate(desc) for c, ch in enumerate(row) if ch == "H"]
    (sr, sc), (gr, gc) = _find(desc, "S"), _find(desc, "G")
    assert text.split("\n") == [
        "Board size: 4 rows x 4 cols (zero-indexed).", f"Start: ({sr}, {sc})",
        f"Goal: ({gr}, {gc})", f"Player: ({sr}, {sc})",
        "Holes: " + ", ".join(f"({r}, {c})" for r, c in holes)]
    # walk to the goal: the player line becomes "Player on goal" (RAGEN's label)
    for move in _path(desc, (sr, sc), "G"):
        text, reward, done, _ = env.step(move)
    assert done and reward == 1.0
    assert f"Player on goal: ({gr}, {gc})" in text.split("\n")
    grid_env = make("frozen_lake", size=4, observation_format="grid")
    both_env = make("frozen_lake", size=4, observation_format="grid_coord")
    coord_env = make("frozen_lake", size=4, observation_format="coord")
    for seed in range(5):
        assert both_env.reset(seed) == (f"Coordinates:\n{coord_env.reset(seed)}\n"
                                        f"Grid Map:\n{grid_env.reset(seed)}")
    assert "(3, 3) the bottom-right" in both_env.instruction
    assert "zero-indexed" not in grid_env.instruction
