"""BabaIsAI: the mechanics on hand-built levels (expected values worked out by hand from the
game's rules), the text view, and every task id's levels: solved by a search over the engine's
states, the plan replayed through the env from a fresh reset, same seed same level in another
process, different seeds different levels, and each task's layout (which rules hold, which
distractors exist, where baba starts) as the generators' descriptions say."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from babaisai_search import solve
from ragen_mega.envs import make
from ragen_mega.envs.babaisai.grid import parse_level
from ragen_mega.envs.babaisai.levels import TASKS, generate

REPO = Path(__file__).resolve().parent.parent


def env_on(level: str, **kwargs):
    env = make("babaisai", **kwargs)
    env.load_level(level)
    return env


def names(env, x, y) -> list[str]:
    """The stack of cell (x, y), bottom first, as "kind:name"."""
    return [f"{t.kind}:{t.name}" for t in env.grid.cells[y * env.grid.width + x]]


def rules(obs: str) -> list[str]:
    return obs.split("\n\n")[0].splitlines()[1:]


# Levels are written in interior coordinates: the cell in column c, row r (from 1) is (c, r).
FORM = """
.    .    .    .    .
BABA IS   YOU  .    .
.    .    .    .    .
baba KEY  .    IS   WIN
.    .    .    .    key
"""


def test_pushing_a_word_forms_a_rule_then_the_win_object_wins_with_the_step_reward():
    env = env_on(FORM)
    assert rules(env.render()) == ["baba is you"]
    obs, reward, done, info = env.step("right")  # KEY (2,4) -> (3,4): KEY IS WIN at 3..5
    assert rules(obs) == ["baba is you", "key is win"]
    assert (reward, done, info["action_is_effective"]) == (0.0, False, True)
    assert names(env, 2, 4) == ["object:baba"] and names(env, 3, 4) == ["noun:key"]
    for action in ("down", "right", "right"):  # (2,5), (3,5), (4,5)
        assert env.step(action)[1:3] == (0.0, False)
    obs, reward, done, info = env.step("right")  # onto the key at (5,5), step 5
    assert done and info["success"]
    assert reward == pytest.approx(1 - 0.9 * 5 / 100)  # 0.955


def test_binary_reward_and_max_steps_scale_the_win_reward():
    env = env_on(FORM, binary_reward=True)
    assert [env.step(a)[1] for a in ("right", "down", "right", "right", "right")][-1] == 1.0
    env = env_on(FORM, max_steps=20)
    assert [env.step(a)[1] for a in ("right", "down", "right", "right", "right")][-1] == \
        pytest.approx(1 - 0.9 * 5 / 20)  # 0.775


BREAK = """
.    .    .    .
KEY  IS   WIN  .
.    baba .    key
BABA IS   YOU  .
"""


def test_pushing_a_word_out_of_line_breaks_the_rule_and_the_key_no_longer_wins():
    env = env_on(BREAK)
    assert rules(env.render()) == ["key is win", "baba is you"]
    obs, *_ = env.step("up")  # IS (2,2) -> (2,1)
    assert rules(obs) == ["baba is you"] and names(env, 2, 1) == ["is:is"]
    for action in ("down", "right"):
        env.step(action)
    obs, reward, done, info = env.step("right")  # onto the key at (4,3): walked over
    assert (reward, done, info["success"]) == (0.0, False, False)
    assert names(env, 4, 3) == ["object:key", "object:baba"]


def test_a_push_chain_moves_together_and_a_chain_against_the_border_does_not_move():
    env = env_on("""
baba KEY  IS   WIN  .
BABA IS   YOU  .    .
""")
    env.step("right")
    assert [names(env, x, 1) for x in range(1, 6)] == [
        [], ["object:baba"], ["noun:key"], ["is:is"], ["property:win"]]
    obs, reward, done, info = env.step("right")  # WIN is at (5,1), the border beyond
    assert info["action_is_valid"] and not info["action_is_effective"]
    assert [names(env, x, 1) for x in range(2, 6)] == [
        ["object:baba"], ["noun:key"], ["is:is"], ["property:win"]]


def test_a_word_cannot_be_pushed_into_the_border():
    env = env_on(BREAK)
    env.step("up")
    env.step("up")  # IS is now at (2,1) against the border: baba stays at (2,2)
    assert names(env, 2, 1) == ["is:is"] and names(env, 2, 2) == ["object:baba"]


def test_stop_blocks_and_without_stop_the_wall_is_walked_over():
    stop = env_on("""
baba wall .
WALL IS   STOP
BABA IS   YOU
""")
    *_, info = stop.step("right")
    assert not info["action_is_effective"] and names(stop, 1, 1) == ["object:baba"]
    free = env_on("""
baba wall .
BABA IS   YOU
""")
    free.step("right")
    assert names(free, 2, 1) == ["object:wall", "object:baba"] and names(free, 1, 1) == []


def test_a_transform_puts_a_new_object_on_top_after_a_move_but_not_after_idle():
    env = env_on("""
ball .    .
BALL IS   KEY
BABA IS   YOU
baba .    .
""")
    assert rules(env.render()) == ["baba is you"]  # transforms are not listed
    env.step("idle")
    assert names(env, 1, 1) == ["object:ball"]
    env.step("right")
    assert names(env, 1, 1) == ["object:ball", "object:key"]
    assert env.grid.top(1, 1).color == "blue"  # a key's default colour


def test_only_the_win_object_wins_and_colour_rules_pick_their_colour():
    env = env_on("""
red:ball baba blue:ball .
RED      BALL IS        WIN
BABA     IS   YOU       .
""")
    assert rules(env.render()) == ["red ball is win", "baba is you"]
    *_, info = env.step("right")  # onto the blue ball
    assert not info["success"]
    *_, done, info = env.step("left")  # back to (2,1): empty
    assert not done
    *_, done, info = env.step("left")  # the red ball
    assert done and info["success"]


def test_win_is_tested_where_the_mover_ends_up_a_blocked_mover_on_its_own_cell():
    blocked = env_on("""
baba key  .
KEY  IS   WIN
KEY  IS   STOP
BABA IS   YOU
""")
    *_, done, info = blocked.step("right")  # the key is WIN but STOP: baba stays, no win
    assert not done and not info["success"] and not info["action_is_effective"]
    itself = env_on("""
baba .    .
BABA IS   YOU
BABA IS   WIN
""")
    _, reward, done, info = itself.step("left")  # into the border: its own cell, a WIN baba
    assert done and info["success"] and reward == pytest.approx(1 - 0.9 * 1 / 100)


def test_push_objects_and_lose_and_only_the_top_of_a_stack_counts():
    env = env_on("""
baba ball .    key
BALL IS   PUSH .
KEY  IS   LOSE .
BABA IS   YOU  .
""")
    env.step("right")  # ball (2,1) -> (3,1)
    env.step("right")  # ball -> (4,1), on top of the key (the key is not STOP)
    assert names(env, 4, 1) == ["object:key", "object:ball"]
    _, reward, done, _ = env.step("right")  # ball stuck at the border; not STOP: walked over
    assert (reward, done) == (0.0, False)  # the LOSE key is under the ball: inactive
    assert names(env, 4, 1) == ["object:key", "object:ball", "object:baba"]
    lose = env_on("""
baba key .
KEY  IS   LOSE
BABA IS   YOU
""")
    _, reward, done, info = lose.step("right")
    assert (reward, done, info["success"]) == (-1.0, True, False)


def test_rules_read_in_both_directions_through_one_is_in_reading_order():
    env = env_on("""
.    KEY  .
BABA IS   YOU
.    WIN  .
baba .    key
""")
    assert rules(env.render()) == ["baba is you", "key is win"]


def test_idle_and_invalid_text_and_the_step_limit():
    env = env_on(FORM, max_steps=100)
    assert env.step("jump")[3]["action_is_valid"] is False and env.steps == 0
    for step in range(1, 100):
        obs, reward, done, info = env.step("idle")
        assert (reward, done, info["action_is_effective"]) == (0.0, False, False)
    obs, reward, done, info = env.step("idle")
    assert (reward, done, info["success"], env.steps) == (0.0, True, False, 100)
    with pytest.raises(RuntimeError, match="episode is done"):
        env.step("idle")


def test_breaking_baba_is_you_ends_the_episode_with_clean_text():
    env = env_on("""
.    baba .
BABA IS   YOU
.    .    .
""")
    obs, reward, done, info = env.step("down")  # IS (2,2) -> (2,3)
    assert (reward, done, info["success"], info["no_you_left"]) == (0.0, True, False, True)
    assert obs == "Active rules:\n\nNo object is YOU any more, so nothing can move."


def test_text_view_offsets_and_add_ruleset():
    level = """
.    .    .    .    .
BABA IS   YOU  .    .
.    .    .    .    .
baba KEY  .    IS   WIN
.    .    .    .    red:key
"""
    expected_objects = ("Objects on the map:\n"
                        "rule `baba` 2 steps up\n"
                        "rule `is` 1 step to the right and 2 steps up\n"
                        "rule `you` 2 steps to the right and 2 steps up\n"
                        "rule `key` 1 step to the right\n"
                        "rule `is` 3 steps to the right\n"
                        "rule `win` 4 steps to the right\n"
                        "key 4 steps to the right and 1 step down")
    assert env_on(level).render() == "Active rules:\nbaba is you\n\n" + expected_objects
    assert env_on(level, add_ruleset=False).render() == expected_objects


def test_text_view_matches_balrogs_published_example():
    """BALROG's text for a goto_win-distr_obj level (baba at (6,5), blue key at (3,5), red ball
    at (2,3)), with "steps" for every count above one."""
    env = env_on("""
KEY  IS   WIN      .        .    .
.    .    .        .        .    .
.    red:ball .    .        .    .
.    .    .        .        .    .
.    .    blue:key .        .    baba
BABA IS   YOU      .        .    .
""")
    assert env.render() == """Active rules:
key is win
baba is you

Objects on the map:
rule `key` 5 steps to the left and 4 steps up
rule `is` 4 steps to the left and 4 steps up
rule `win` 3 steps to the left and 4 steps up
ball 4 steps to the left and 2 steps up
key 3 steps to the left
rule `baba` 5 steps to the left and 1 step down
rule `is` 4 steps to the left and 1 step down
rule `you` 3 steps to the left and 1 step down"""


def test_bad_kwargs_and_levels_are_clear_errors():
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make("babaisai", task="nope")
    with pytest.raises(ValueError, match="max_steps"):
        make("babaisai", max_steps=0)
    with pytest.raises(ValueError, match="add_ruleset"):
        make("babaisai", add_ruleset="yes")
    with pytest.raises(ValueError, match="same number of cells"):
        parse_level("baba .\nKEY")
    assert make("babaisai", task="env/two_room-goto_win").task == "two_room-goto_win"


# -- the 40 task ids --------------------------------------------------------------------------

BALROG_TASKS = (
    [f"{p}{s}" for p in ("goto_win", "make_win") for s in
     ("", "-distr_obj", "-distr_rule", "-distr_obj_rule", "-distr_obj-irrelevant_rule")]
    + [f"two_room-{p}{s}" for p in ("goto_win", "break_stop-goto_win",
                                    "maybe_break_stop-goto_win", "make_win",
                                    "break_stop-make_win")
       for s in ("", "-distr_obj", "-distr_rule", "-distr_obj_rule",
                 "-distr_obj-irrelevant_rule", "-distr_win_rule")
       if s != "-distr_win_rule" or p in ("goto_win", "make_win")]
    + ["two_room-make_you", "two_room-make_you-make_win", "two_room-make_wall_win"])
SEEDS = (0, 1, 2)


def test_the_task_list_is_balrogs_forty():
    assert len(BALROG_TASKS) == 40 and sorted(TASKS) == sorted(BALROG_TASKS)


@pytest.mark.parametrize("task", BALROG_TASKS)
def test_levels_are_solvable_and_the_plan_wins_from_a_fresh_reset(task):
    for seed in SEEDS:
        env = make("babaisai", task=task)
        env.reset(seed)
        plan = solve(env.grid.copy())
        assert plan is not None and len(plan) <= 100, (task, seed)
        replay = make("babaisai", task=task)
        replay.reset(seed)
        for i, action in enumerate(plan):
            obs, reward, done, info = replay.step(action)
            assert done == (i == len(plan) - 1), (task, seed, i)
        assert info["success"] and reward == pytest.approx(1 - 0.9 * len(plan) / 100)


def _layout(task: str, seed: int):
    """Grid, objects other than baba and walls, noun blocks (hidden ones too), baba's cell,
    active rules."""
    grid = generate(task, seed)
    things = [t for stack in grid.cells for t in stack]
    objects = [t.name for t in things if t.kind == "object" and t.name not in ("baba", "wall")]
    nouns = sorted(t.name for t in things if t.kind == "noun")
    baba = next((x, y) for x, y, t in grid.tops() if t.kind == "object" and t.name == "baba")
    return grid, objects, nouns, baba, {r.text() for r in grid.rules.rules}


@pytest.mark.parametrize("task", BALROG_TASKS)
def test_layouts_follow_the_task_description(task):
    two_room = task.startswith("two_room")
    suffix = next((s for s in ("distr_obj-irrelevant_rule", "distr_obj_rule", "distr_win_rule",
                               "distr_obj", "distr_rule") if task.endswith(s)), "")
    for seed in range(8):
        grid, objects, nouns, baba, active = _layout(task, seed)
        assert (grid.width, grid.height) == ((13, 9) if two_room else (8, 8))
        assert "baba is you" in active
        wins = [r for r in active if r.endswith(" is win")]
        if "make_win" in task or "make_wall_win" in task:
            assert not [w for w in wins if w.split()[0] in objects], (task, seed, active)
        elif "make_you" not in task:
            assert any(w.split()[0] in objects for w in wins), (task, seed, active)
        if two_room:
            stop_kept = not task.startswith(("two_room-goto_win", "two_room-make_win"))
            assert ("wall is stop" in active) == stop_kept, (task, seed)
            assert [grid.top(6, y).name for y in range(1, 8)] == ["wall"] * 7
        extra_objects = 1 if "make_you" in task or "make_wall_win" in task else \
            int(suffix in ("distr_obj", "distr_obj_rule", "distr_obj-irrelevant_rule",
                           "distr_win_rule"))
        assert len(objects) == 1 + extra_objects, (task, seed, objects)
        base_nouns = (3 if two_room else 2) + int("make_you" in task or "make_wall_win" in task)
        extra_nouns = int(suffix in ("distr_rule", "distr_obj_rule", "distr_obj-irrelevant_rule")) \
            + 2 * int(suffix == "distr_win_rule")
        assert len(nouns) == base_nouns + extra_nouns, (task, seed, nouns)
        if two_room:  # baba starts in a left-room pushable area
            assert 2 <= baba[0] <= 5 and 3 <= baba[1] <= 5, (task, seed, baba)
        else:
            assert 1 <= baba[0] <= 6 and 2 <= baba[1] <= 6, (task, seed, baba)


def level_digests(seed: int) -> dict[str, str]:
    return {task: hashlib.sha256(repr(generate(task, seed).state_key()).encode()).hexdigest()
            for task in BALROG_TASKS}


def test_same_seed_same_level_in_another_process_and_seeds_differ():
    code = ("import json, sys; sys.path.insert(0, 'tests'); from test_babaisai import "
            "level_digests; print(json.dumps(level_digests(7)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == level_digests(7)
    for task in BALROG_TASKS:
        assert len({generate(task, s).state_key() for s in range(6)}) == 6, task
