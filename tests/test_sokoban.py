"""Sokoban: generated levels are solvable (an independent BFS on the text observation solves
them, and replaying its plan through the env ends with success and the +10 reward), rewards
match gym-sokoban's on a hand-worked level, and the text uses RAGEN's legend."""
from __future__ import annotations

from collections import deque

import pytest

from ragen_mega.envs import make

# RAGEN's grid vocabulary, written here independently of the env code.
MOVES = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}


def parse(text: str):
    """Text grid -> (walls, targets, boxes, player) as sets of (row, col)."""
    walls, targets, boxes, player = set(), set(), set(), None
    for r, row in enumerate(text.split("\n")):
        for c, ch in enumerate(row):
            assert ch in "#_OX√PS", f"unexpected symbol {ch!r} in\n{text}"
            if ch == "#":
                walls.add((r, c))
            if ch in "O√S":
                targets.add((r, c))
            if ch in "X√":
                boxes.add((r, c))
            if ch in "PS":
                assert player is None, "two players"
                player = (r, c)
    return walls, targets, frozenset(boxes), player


def bfs_solve(text: str, limit: int = 500_000) -> list[str]:
    """Shortest move sequence that puts every box on a target (plain BFS over positions)."""
    walls, targets, boxes, player = parse(text)
    start = (player, boxes)
    parent = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        pos, bxs = state
        if bxs <= targets:
            plan = []
            while parent[state] is not None:
                state, move = parent[state]
                plan.append(move)
            return plan[::-1]
        for move, (dr, dc) in MOVES.items():
            nxt = (pos[0] + dr, pos[1] + dc)
            if nxt in walls:
                continue
            new_boxes = bxs
            if nxt in bxs:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if beyond in walls or beyond in bxs:
                    continue
                new_boxes = (bxs - {nxt}) | {beyond}
            new = (nxt, new_boxes)
            if new not in parent:
                parent[new] = (state, move)
                queue.append(new)
        assert len(parent) < limit, "search too large"
    raise AssertionError(f"BFS found no solution for\n{text}")


@pytest.mark.parametrize("dim_room,num_boxes,seeds", [
    ((6, 6), 1, range(150)),
    ((7, 7), 2, range(40)),
    ((8, 8), 2, range(30)),
    ((6, 9), 1, range(40)),
    ((7, 7), 3, range(10)),
])
def test_generated_levels_are_solvable_and_pay_the_finish_reward(dim_room, num_boxes, seeds):
    env = make("sokoban", dim_room=dim_room, num_boxes=num_boxes)
    plan_lengths = []
    for seed in seeds:
        obs = env.reset(seed)
        walls, targets, boxes, player = parse(obs)
        rows = obs.split("\n")
        assert (len(rows), len(rows[0])) == dim_room
        assert len(boxes) == len(targets) == num_boxes
        assert not boxes <= targets, f"seed {seed}: level starts solved"
        assert all(ch == "#" for ch in rows[0] + rows[-1]), "top/bottom border must be walls"
        plan = bfs_solve(obs)
        plan_lengths.append(len(plan))
        for i, move in enumerate(plan):
            obs, reward, done, info = env.step(move)
            assert info["action_is_valid"] and info["action_is_effective"]
            assert done == (i == len(plan) - 1), f"seed {seed}: done at move {i}/{len(plan)}"
        assert info["success"] is True
        assert reward == pytest.approx(-0.1 + 1.0 + 10.0)
        assert parse(obs)[2] <= targets
    # The reverse-play scramble should mostly make levels harder than one push.
    assert max(plan_lengths) >= 4 and plan_lengths.count(1) < len(plan_lengths) / 2, plan_lengths


HAND_LEVEL = "\n".join([
    "#######",
    "#P√___#",
    "#_____#",
    "#_X__O#",
    "#######",
])


def test_rewards_on_a_hand_worked_level():
    env = make("sokoban", dim_room=(5, 7), num_boxes=2)
    assert env.load_level(HAND_LEVEL) == HAND_LEVEL
    # (action, reward, effective, done) worked out by hand from gym-sokoban's rules
    script = [
        ("Up", -0.1, False, False),       # into the wall
        ("Right", -1.1, True, False),     # box pushed off its target
        ("Down", -0.1, True, False),
        ("Right", -0.1, True, False),
        ("Right", -0.1, True, False),
        ("Up", -0.1, True, False),        # now right of the box
        ("Left", 0.9, True, False),       # box pushed back onto the target
        ("Down", -0.1, True, False),
        ("Left", -0.1, True, False),
        ("Left", -0.1, True, False),
        ("Down", -0.1, True, False),      # left of the second box
        ("Right", -0.1, True, False),
        ("Right", -0.1, True, False),
        ("Right", 10.9, True, True),      # last box on its target: -0.1 + 1 + 10
    ]
    for i, (action, reward, effective, done) in enumerate(script):
        obs, r, d, info = env.step(action.upper() if i % 2 else action.lower())
        assert (r, info["action_is_effective"], d) == (pytest.approx(reward), effective, done), \
            f"step {i} {action}:\n{obs}"
        assert info["success"] is done
        if i == 1:  # player on the emptied target shows as S, the pushed box as X
            assert obs.split("\n")[1] == "#_SX__#"
    assert obs == "\n".join(["#######", "#_√___#", "#_____#", "#___P√#", "#######"])


@pytest.mark.parametrize("level", ["######\n#O_PX#\n######",      # box against a wall
                                   "######\n#PX√O#\n######"])     # box against a box
def test_blocked_push_is_valid_but_not_effective(level):
    env = make("sokoban")
    env.load_level(level)
    obs, reward, done, info = env.step("Right")
    assert obs == level and reward == pytest.approx(-0.1) and not done
    assert info["action_is_valid"] and not info["action_is_effective"]


def test_step_limit_invalid_actions_and_errors():
    env = make("sokoban", max_steps=3)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Up")
    obs = env.load_level("######\n#O_PX#\n######")
    for garbage in ["", "north", "Up Up", None, "x" * 100_000, "<answer>Up</answer>"]:
        o, r, d, info = env.step(garbage)
        assert (o, r, d) == (obs, 0.0, False)
        assert not info["action_is_valid"] and not info["success"]
    results = [env.step("Right") for _ in range(3)]  # blocked pushes still count as steps
    assert [d for _, _, d, _ in results] == [False, False, True]
    assert not results[-1][3]["success"]
    with pytest.raises(RuntimeError, match="done"):
        env.step("Up")
    for kwargs, name in [({"dim_room": (4, 6)}, "dim_room"), ({"dim_room": 6}, "dim_room"),
                         ({"num_boxes": 0}, "num_boxes"), ({"num_boxes": 5}, "num_boxes"),
                         ({"max_steps": 0}, "max_steps"), ({"search_depth": -1}, "search_depth")]:
        with pytest.raises(ValueError, match=name):
            make("sokoban", **kwargs)
    with pytest.raises(ValueError, match="seed"):
        env.reset(-1)
    with pytest.raises(ValueError, match="symbol"):
        env.load_level("#####\n#P?O#\n#####")


def test_move_reward_is_the_reward_of_every_valid_move():
    """``move_reward`` replaces gym-sokoban's -0.1 per move (kept as the default); a move that
    changes no box pays exactly it, a plain step or a bump into a wall alike."""
    for kwargs, cost in [({}, -0.1), ({"move_reward": -0.01}, -0.01), ({"move_reward": 0}, 0.0),
                         ({"move_reward": 0.25}, 0.25)]:
        env = make("sokoban", **kwargs)
        for seed in range(5):
            walls, targets, boxes, (r, c) = parse(env.reset(seed))
            free = [m for m, (dr, dc) in MOVES.items()
                    if (r + dr, c + dc) not in walls | boxes]
            _, reward, done, info = env.step(free[0])        # onto an empty cell or a target
            assert (reward, done, info["action_is_effective"]) == (cost, False, True), seed
        env.load_level("#####\n#_P_#\n#XO_#\n#####")
        _, reward, _, info = env.step("Up")                  # into the wall
        assert (reward, info["action_is_effective"]) == (cost, False)
        _, reward, _, info = env.step("north")               # invalid: the env pays 0
        assert reward == 0.0 and not info["action_is_valid"]


def test_move_reward_is_added_to_the_box_bonuses():
    """HAND_LEVEL's script (test_rewards_on_a_hand_worked_level) with move_reward=-0.01: every
    move pays -0.01; a push off a target -1, onto one +1, the finish +10 on top."""
    env = make("sokoban", dim_room=(5, 7), num_boxes=2, move_reward=-0.01)
    env.load_level(HAND_LEVEL)
    moves = ["Up", "Right", "Down", "Right", "Right", "Up", "Left", "Down", "Left", "Left",
             "Down", "Right", "Right", "Right"]
    rewards = [env.step(move)[1] for move in moves]
    assert rewards[1] == pytest.approx(-1.01)    # -0.01 - 1: box pushed off its target
    assert rewards[6] == pytest.approx(0.99)     # -0.01 + 1: box pushed back onto it
    assert rewards[13] == pytest.approx(10.99)   # -0.01 + 1 + 10: last box on, level solved
    assert [r for i, r in enumerate(rewards) if i not in (1, 6, 13)] == [-0.01] * 11
    assert sum(rewards) == pytest.approx(11 * -0.01 - 1.01 + 0.99 + 10.99)
    # one box, one push: the solving push pays move_reward + 1 + 10
    env = make("sokoban", move_reward=0)
    env.load_level("#####\n#PXO#\n#####")
    _, reward, done, info = env.step("Right")
    assert reward == pytest.approx(11.0) and done and info["success"]


@pytest.mark.parametrize("bad", [True, False, float("nan"), float("inf"), -float("inf"), None,
                                 "-0.1", [-0.1]])
def test_move_reward_rejects_non_numbers(bad):
    with pytest.raises(ValueError, match="move_reward"):
        make("sokoban", move_reward=bad)
