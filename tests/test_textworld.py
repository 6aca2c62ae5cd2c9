"""TextWorld (BALROG's three tasks) against textworld's own generator and an exact random walk.

Small games keep generation cheap (about a second a coin game, five for a cooking game): coin
collector level 4 (a chain of 4 rooms), treasure hunter level 3, the cooking game at BALROG's
settings. Games are generated into a directory of this module's own.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from conftest import served_and_local
from ragen_mega.envs import make
from ragen_mega.envs.textworld_references import random_admissible, references

SMALL = {"coin_collector": {"level": 4}, "treasure_hunter": {"level": 3},
         "the_cooking_game": {}}


@pytest.fixture(scope="module")
def games_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("textworld_games"))


def _env(games_dir, task="coin_collector", **kwargs):
    return make("textworld", task=task, cache_dir=games_dir,
                **{**SMALL[task], "games": 4, **kwargs})


@pytest.mark.parametrize("task", sorted(SMALL))
def test_walkthrough_wins_with_a_return_of_one(games_dir, task):
    """textworld's recorded winning commands, played from the start: each a valid step (or, in
    the cooking game, an ``open`` of what is open already: textworld's walkthrough opens every
    door it passes), the normalised rewards summing to 1, the last step won (success,
    progression 1, done). The first observation is the objective and the room, without the
    banner or the status line; ``goal`` prints the objective and changes nothing."""
    env = _env(games_dir, task)
    first = env.reset(0)
    objective = first.split("\n\n")[0]
    assert "$$" not in first and "\n>" not in first and "-= " in first
    obs, reward, done, info = env.step("goal")
    assert obs == objective and (reward, done) == (0.0, False)
    assert info["action_is_valid"] and not info["action_is_effective"]
    total, steps = 0.0, env.walkthrough(0)
    assert steps
    for i, command in enumerate(steps):
        _, reward, done, info = env.step(command)
        assert info["action_is_valid"] or (task == "the_cooking_game"
                                           and command.startswith("open ")), (task, command)
        total += reward
        assert done == (i == len(steps) - 1), (task, i, command)
    assert info["success"] and info["progression"] == 1.0 and total == pytest.approx(1.0)
    env.close()


def test_cooking_progression_is_the_score_so_far(games_dir):
    """Half of a cooking game's walkthrough: BALROG's progression (score / max score) is
    strictly between 0 and 1, equals the rewards so far, and the game is neither won nor over."""
    env = _env(games_dir, "the_cooking_game")
    env.reset(1)
    steps, total = env.walkthrough(1), 0.0
    for command in steps[:len(steps) // 2]:
        _, reward, done, info = env.step(command)
        total += reward
    assert info["max_score"] > 1 and 0 < info["progression"] < 1 and not done
    assert total == pytest.approx(info["score"] / info["max_score"]) == info["progression"]
    env.close()


def test_commands_the_game_would_not_take_cost_no_step(games_dir):
    """With ``max_steps=3``: garbage and a wall before each command are invalid steps (the same
    observation, no reward, no step counted); the third valid command ends the episode."""
    env = _env(games_dir, max_steps=3)
    obs = env.reset(2)
    walls = [f"go {d}" for d in ("north", "south", "east", "west")
             if f"go {d}" not in env.admissible_commands()]
    for i in range(3):
        for text in ["", "asdf", "x" * 100_000, None, *walls[:1], "take coin"]:
            got = env.step(text)
            assert got[:3] == (obs, 0.0, False) and not got[3]["action_is_valid"], text
        obs, _, done, info = env.step("look")
        assert info["action_is_valid"] and done == (i == 2)
    assert not info["success"]
    env.close()


def test_seeds_pick_games_of_their_split(games_dir):
    """Seed s and s + games play the same game; another env instance plays it alike; the test
    split's game 0 is another game than the train split's."""
    a, b = _env(games_dir), _env(games_dir)
    assert a.reset(1) == b.reset(5) and a.walkthrough(1) == b.walkthrough(5)
    test = _env(games_dir, split="test")
    assert (test.reset(0), test.walkthrough(0)) != (a.reset(0), a.walkthrough(0))
    assert a.reset(0) != a.reset(1)
    for env in (a, b, test):
        env.close()


def test_state_key_is_the_game_state(games_dir):
    """GiGPO's key: ``goal`` and ``look`` keep it (their text differs), a move changes it,
    walking back restores it."""
    env = _env(games_dir)
    start = env.state_key(env.reset(0))
    assert env.state_key(env.step("goal")[0]) == start == env.state_key(env.step("look")[0])
    first = env.walkthrough(0)[0]
    back = {"north": "south", "south": "north", "east": "west", "west": "east"}[first.split()[1]]
    moved = env.state_key(env.step(first)[0])
    assert moved != start and env.state_key(env.step(f"go {back}")[0]) == start
    env.close()


def test_show_commands_lists_what_the_game_takes(games_dir):
    env = _env(games_dir, show_commands=True)
    obs = env.reset(0)
    listed = obs.rsplit("Admissible commands: ", 1)[1].split(", ")
    assert set(listed) == env.admissible_commands() | {"goal", "look", "inventory"}
    env.close()


def _exact_random_walk(env, seed: int, budget: int) -> float:
    """Success of uniformly random admissible commands within ``budget``, by dynamic
    programming over the rooms: the room graph is read off the game (each room's commands, and
    where each ``go`` leads), then P(win within t) is computed exactly."""
    def room_after(path):
        env.reset(seed)
        for command in path:
            env.step(command)
        return env.state_key(""), env.admissible_commands()

    rooms, paths, todo = {}, {}, [()]
    while todo:
        path = todo.pop()
        key, commands = room_after(path)
        if key in rooms:
            continue
        rooms[key], paths[key] = {}, path
        for command in sorted(commands):
            if command.startswith("go "):
                rooms[key][command] = room_after(path + (command,))[0]
                todo.append(path + (command,))
            else:
                rooms[key][command] = "win" if command == "take coin" else key

    @functools.lru_cache(maxsize=None)
    def win(room, t):
        if t == 0:
            return 0.0
        moves = rooms[room]
        return sum(1.0 if to == "win" else win(to, t - 1) for to in moves.values()) / len(moves)

    return win(room_after(())[0], budget)


def test_random_agent_matches_the_exact_random_walk(games_dir):
    """The ``random_valid`` line's estimate (400 random games) against the exact probability on
    a 4-room chain, within 4 binomial standard errors."""
    env = _env(games_dir)
    budget, episodes = 8, 400
    exact = _exact_random_walk(env, 3, budget)
    estimate, progression = random_admissible(env, 3, budget, episodes)
    assert 0.05 < exact < 0.95 and estimate == progression
    assert abs(estimate - exact) <= 4 * np.sqrt(exact * (1 - exact) / episodes), (estimate, exact)
    env.close()


def test_reference_lines_under_the_budget(games_dir):
    """``optimal`` is 1 when the walkthrough (3 moves and ``take coin`` on a 4-room chain) fits
    the turns, 0 when it does not; the random agent does no better than it."""
    kwargs = {"task": "coin_collector", "cache_dir": games_dir, **SMALL["coin_collector"],
              "games": 4}
    fits = references(kwargs, [0, 1], max_turns=4, max_actions_per_turn=1)
    short = references(kwargs, [0, 1], max_turns=3, max_actions_per_turn=1)
    assert fits["optimal"] == 1.0 and short["optimal"] == 0.0 and short["random_valid"] == 0.0
    assert fits["random_valid"] <= fits["optimal"]


@pytest.mark.parametrize("kwargs, named", [
    ({"task": "zork"}, "task"), ({"level": 0}, "level"), ({"level": 301}, "level"),
    ({"task": "the_cooking_game", "level": 3}, "level"), ({"split": "dev"}, "split"),
    ({"games": 0}, "games"), ({"max_steps": 0}, "max_steps"),
    ({"show_commands": "yes"}, "show_commands")])
def test_bad_kwargs_name_the_kwarg(kwargs, named):
    with pytest.raises(ValueError, match=named):
        make("textworld", **kwargs)


def test_served_games_play_as_local_ones(games_dir, tokenizer):
    """``ragen-mega env-server textworld``: the same seeds and answers (moves, a wall, ``goal``,
    garbage) played on the server and in this process give equal samples and metrics."""
    kwargs = {"task": "coin_collector", "level": 4, "games": 4, "cache_dir": games_dir}
    answers = [f" go </think><answer> {a} </answer>" for a in
               ("go west", "go north", "goal", "go east", "take coin", "look")]
    local, remote = served_and_local("textworld", kwargs, answers, tokenizer)
    for lo, re in zip(local, remote):
        assert re.samples == lo.samples and re.metrics == lo.metrics
    assert {e.metrics["valid_action_rate"] for e in local} - {0.0, 1.0}   # some moves hit walls
