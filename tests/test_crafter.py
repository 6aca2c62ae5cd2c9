"""Crafter text env: reproducible across processes, equal to rendering crafter step for step,
text checked against crafter's semantic map and inventory, a BFS-scripted wood collection."""
from __future__ import annotations

import re
import subprocess
import sys
from collections import deque

import crafter
import numpy as np
import pytest

from ragen_mega.envs import make
from ragen_mega.envs.crafter_env import ReproducibleCrafter

VIEW = (9, 7)  # crafter's image shows 9 x 7 world cells (9 x 9 grid minus 2 inventory rows)
GROUND = {"grass", "sand", "path"}

REPLAY = """
import hashlib
import numpy as np
from ragen_mega.envs import make

def replay(env):
    h = hashlib.sha256(env.reset(7).encode())
    for a in np.random.RandomState(3).randint(0, 17, size=200):
        obs, reward, done, info = env.step(env.valid_actions[a])
        h.update(obs.encode() + info["semantic"].tobytes())
        state = (sorted(info["inventory"].items()), reward, done, info["achievements"])
        h.update(repr(state).encode())
        if done:
            break
    return h.hexdigest()

env = make("crafter")
print(replay(env), replay(env), replay(make("crafter")))
"""


def test_same_seed_same_episode_in_two_processes_and_after_other_episodes():
    """Each process replays seed 7 three times: fresh, again on the same env (other objects,
    other memory addresses), and on a second env. All six runs must agree; crafter as shipped
    does not (its creatures' order comes from their addresses)."""
    procs = [subprocess.Popen([sys.executable, "-c", REPLAY], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    hashes = outs[0] + outs[1]
    assert len(hashes) == 6 and len(set(hashes)) == 1


class _ReversedChunkOrder(ReproducibleCrafter):
    """Same as ReproducibleCrafter but the chunk's objects in the opposite order."""

    def _balance_chunk(self, chunk, objs):
        crafter.Env._balance_chunk(self, chunk, sorted(objs, key=lambda o: tuple(o.pos))[::-1])


class _Rendering(ReproducibleCrafter):
    """Sorted chunk objects, but crafter's own image rendering every step."""

    _obs = crafter.Env._obs


class _SkipRenderWithoutNoiseDraw(ReproducibleCrafter):
    def _obs(self):
        return None


def _trajectory(env, actions):
    env.reset_to_seed(1)
    states, nights = [], 0
    for a in actions:
        obs, _, done, info = env.step(int(a))
        nights += env.world.daylight < 0.5
        states.append(info["semantic"].tobytes() + repr(sorted(info["inventory"].items())).encode())
        if done:
            break
    return states, nights, obs


def test_render_skip_keeps_crafter_dynamics_and_chunk_order_matters():
    """Skipping the image (with the night-noise draw kept) changes nothing; dropping that draw,
    or visiting a chunk's creatures in another order, changes the world: the two effects the
    subclass has to handle are real."""
    actions = np.random.RandomState(0).choice([0, 1, 2, 3, 4, 5], size=400)  # noop/moves/do
    ours, nights, obs = _trajectory(ReproducibleCrafter(), actions)
    rendered, _, image = _trajectory(_Rendering(), actions)
    assert obs is None and image.shape == (64, 64, 3)
    assert nights > 20, "the run must reach the night, where rendering draws random noise"
    assert ours == rendered
    assert _trajectory(_SkipRenderWithoutNoiseDraw(), actions)[0] != rendered
    assert _trajectory(_ReversedChunkOrder(), actions)[0] != ours


def _name_to_ids(game) -> dict[str, set[int]]:
    """Thing name -> semantic ids, from crafter's own tables."""
    ids = {name: {i} for name, i in game._world._mat_ids.items() if name}
    ids.update({cls.__name__.lower(): {i} for cls, i in game._sem_view._obj_ids.items()})
    ids["ripe plant"] = ids["plant"]
    return ids


def _offset(words: str) -> tuple[int, int]:
    dx = dy = 0
    for count, word in re.findall(r"(\d+) steps? (up|down|left|right)", words):
        n = int(count)
        dx += {"left": -n, "right": n}.get(word, 0)
        dy += {"up": -n, "down": n}.get(word, 0)
    return dx, dy


def _check_text(text, info, ids, facing):
    sem, (px, py) = info["semantic"], info["player_pos"]
    lines = text.splitlines()
    inv = info["inventory"]
    status = dict(re.findall(r"(\w+) (\d+)/9", next(l for l in lines if l.startswith("Status:"))))
    assert sorted(status) == sorted(("health", "food", "drink", "energy"))
    assert {k: int(v) for k, v in status.items()} == {k: inv[k] for k in status}
    items = next(l for l in lines if l.startswith("Inventory:"))[len("Inventory: "):-1]
    listed = {} if items == "nothing" else {
        n.replace(" ", "_"): int(c) for n, c in (s.rsplit(" ", 1) for s in items.split(", "))}
    assert listed == {k: v for k, v in inv.items() if k not in status and v > 0}
    # every "- thing offset" line: that thing is at that offset, and none of its kind is nearer
    window = {(dx, dy): int(sem[px + dx, py + dy])
              for dx in range(-(VIEW[0] // 2), VIEW[0] // 2 + 1)
              for dy in range(-(VIEW[1] // 2), VIEW[1] // 2 + 1)
              if (dx, dy) != (0, 0)
              and 0 <= px + dx < sem.shape[0] and 0 <= py + dy < sem.shape[1]}
    described = set()
    for line in lines:
        if line.startswith("- "):
            name, words = re.match(r"- (\D+?) (\d.*)", line).groups()
            dx, dy = _offset(words)
            assert window[(dx, dy)] in ids[name], line
            nearest = min(abs(x) + abs(y) for (x, y), i in window.items() if i in ids[name])
            assert abs(dx) + abs(dy) == nearest, line
            described |= ids[name]
    ground = set().union(*(ids[g] for g in GROUND)) | ids["player"]
    assert set(window.values()) - ground <= described
    front = re.search(r"You are facing (\w+); in front of you: (.+)\.", text)
    assert front.group(1) == facing
    fx, fy = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}[facing]
    assert int(sem[px + fx, py + fy]) in ids[front.group(2)]


def test_text_matches_semantic_map_and_inventory():
    env = make("crafter")
    ids = _name_to_ids(env.crafter_env)
    moves = {"move left": (-1, 0), "move right": (1, 0), "move up": (0, -1), "move down": (0, 1)}
    env.reset(2)
    rng = np.random.RandomState(5)
    facing, checked, seen_kinds = "down", 0, set()  # crafter's player starts facing down
    for _ in range(250):
        action = env.valid_actions[rng.choice([0, 1, 2, 3, 4, 5, 5, 5, 7, 8, 10, 11])]
        pos = env.crafter_env.player.pos.copy()
        text, _, done, info = env.step(action)
        if done:
            break
        if action in moves and env.crafter_env.player.sleeping is False:
            # the words mean what the moves do: a move turns you that way, and goes there if free
            facing = action.split()[1]
            step = tuple(int(c) for c in info["player_pos"] - pos)
            assert step in ((0, 0), moves[action])
        _check_text(text, info, ids, facing)
        seen_kinds |= {l[2:].split(" ")[0] for l in text.splitlines() if l.startswith("- ")}
        checked += 1
    assert checked > 100 and len(seen_kinds) >= 3


def _walkable_bfs(game, goal_material):
    """Moves to a free cell next to ``goal_material``, then the move that turns to face it."""
    world, start = game.world, tuple(int(c) for c in game.player.pos)
    dirs = {"move left": (-1, 0), "move right": (1, 0), "move up": (0, -1), "move down": (0, 1)}
    parent, queue = {start: None}, deque([start])
    while queue:
        cell = queue.popleft()
        for name, (dx, dy) in dirs.items():
            nxt = (cell[0] + dx, cell[1] + dy)
            material, obj = world[nxt]
            if material == goal_material:
                plan = [name]
                while parent[cell] is not None:
                    cell, move = parent[cell]
                    plan.append(move)
                return plan[::-1]
            if nxt not in parent and obj is None and material in ("grass", "sand", "path"):
                parent[nxt] = (cell, name)
                queue.append(nxt)
    raise AssertionError(f"no {goal_material} reachable")


def test_scripted_wood_collection_succeeds_and_counts_effective_actions():
    env = make("crafter", success_achievement="collect_wood")
    env.reset(0)
    game = env.crafter_env
    _, _, _, info = env.step("noop")
    assert info["action_is_valid"] and not info["action_is_effective"] and not info["success"]
    for _ in range(40):  # re-plan every step: cows wander into the path
        plan = _walkable_bfs(game, "tree")
        _, reward, done, info = env.step(plan[0] if len(plan) > 1 else plan[0].upper())
        if len(plan) == 1:
            break
    for _ in range(5):  # collecting wood always succeeds with probability 1
        _, reward, done, info = env.step("Do")
        if info["success"]:
            break
    assert info["success"] and info["new_achievements"] == ["collect_wood"]
    assert info["action_is_effective"] and reward >= 1.0 and info["inventory"]["wood"] == 1
    _, _, _, info = env.step("noop")
    assert info["success"] and info["achievements"] == ["collect_wood"]  # stays true


def test_garbage_actions_step_limit_and_bad_kwargs():
    env = make("crafter", max_steps=5)
    text = env.reset(4)
    game = env.crafter_env
    before = (tuple(game.player.pos), game._step, dict(game.player.inventory))
    for garbage in ["", "  ", "walk", "move  diagonally", "x" * 100_000, "ドゥ 🪓", None, 5]:
        obs, reward, done, info = env.step(garbage)
        assert (obs, reward, done) == (text, 0.0, False)
        assert not info["action_is_valid"] and not info["success"]
        assert len(info["invalid_reason"]) < 400
    assert (tuple(game.player.pos), game._step, dict(game.player.inventory)) == before
    dones = [env.step(a)[2] for a in ["NOOP", " Move_Left ", "noop", "noop", "noop"]]
    assert dones == [False] * 4 + [True] and game._step == 5
    with pytest.raises(RuntimeError, match="reset"):  # stepping past the end is a caller bug
        env.step("noop")
    assert game._step == 5
    for kwargs, name in [({"max_steps": 0}, "max_steps"), ({"max_steps": -1}, "max_steps"),
                         ({"max_steps": 1.5}, "max_steps"), ({"max_steps": True}, "max_steps"),
                         ({"success_achievement": "win"}, "success_achievement")]:
        with pytest.raises(ValueError, match=name):
            make("crafter", **kwargs)
