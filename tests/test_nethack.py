"""NetHack and BALROG's MiniHack tasks: the language text against the C++ wrapper's own output,
BALROG's action lists and prompts, paging through --More--, success at the stairs, Boxoban's
shipped levels, NetHack's progression table, and the env server.

``tests/data/nle_language_reference.npz`` holds NLE observations and the text BALROG's C++
language wrapper (``balrog-nle`` 0.9.0, with gym 0.23 and BALROG's minihack fork) wrote for
each, recorded in a separate environment from random play in NetHack and six MiniHack tasks.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import served_and_local
from ragen_mega.envs import make
from ragen_mega.envs.nle_language import NLELanguage, pluralize

DATA = Path(__file__).parent / "data"
MOVES = ["north", "east", "south", "west", "northeast", "southeast", "southwest", "northwest"]


def test_language_text_matches_the_c_wrapper():
    ref = np.load(DATA / "nle_language_reference.npz", allow_pickle=False)
    language = NLELanguage()
    fields = {
        "text_glyphs": lambda i: language.glyphs(ref["glyphs"][i], ref["blstats"][i]),
        "text_message": lambda i: language.message(ref["tty_chars"][i]),
        "text_cursor": lambda i: language.cursor(ref["glyphs"][i], ref["blstats"][i],
                                                 ref["tty_cursor"][i]),
        "text_inventory": lambda i: language.inventory(ref["inv_strs"][i], ref["inv_letters"][i]),
    }
    rows = len(ref["text_glyphs"])
    assert rows >= 100
    for field, text in fields.items():
        wrong = [i for i in range(rows) if text(i) != str(ref[field][i])]
        assert not wrong, (field, wrong[:5], text(wrong[0]), str(ref[field][wrong[0]]))
    # screens made by hand (the trim's quirks), through the C++ as well
    for screen, message in zip(ref["synth_tty_chars"], ref["synth_text_message"]):
        assert language.message(screen) == str(message)
    # the recording covers what the text does beyond a plain step
    messages = [str(m) for m in ref["text_message"]]
    assert any("--More--" in m for m in messages) and any("(end)" in m for m in messages)
    assert any(str(c) and not str(c).startswith("Yourself") for c in ref["text_cursor"])
    assert any(" and " in str(g) for g in ref["text_glyphs"])


@pytest.mark.parametrize("noun, plural", [
    ("newt", "newts"), ("pony", "ponies"), ("monkey", "monkeys"), ("wolf", "wolves"),
    ("staff", "staves"), ("box", "boxes"), ("jellyfish", "jellyfishes"),
    ("homunculus", "homunculuses"), ("pair of boots", "pair of boots"), ("bars", "bars"),
    ("ice", "area of ice"), ("scroll labeled FOO", "scrolls labeled FOO"),
    ("shield 2", "shields 2")])
def test_plurals_follow_the_c_wrappers_rules(noun, plural):
    """The wrapper's own English (not NetHack's makeplural): the recording holds few plurals."""
    assert pluralize(noun) == plural


@pytest.mark.parametrize("task, actions", [
    ("boxoban_hard", MOVES[:4]), ("boxoban_medium", MOVES[:4]), ("mazewalk_9x9", MOVES),
    ("mazewalk_15x15", MOVES), ("corridorbattle_dark", MOVES),
    ("corridor_r3", MOVES + ["open", "kick", "search"]),
    ("quest_easy", MOVES + [f"far {m}" for m in MOVES] + [
        "down", "wait", "more", "apply", "close", "eat", "force", "kick", "loot", "open",
        "pickup", "pray", "puton", "quaff", "search", "zap"]),
])
def test_minihack_tasks_offer_balrogs_actions_in_its_prompt(task, actions):
    """The lists BALROG's wrapper gives each task (recorded with BALROG's stack)."""
    env = make("minihack", task=task)
    try:
        assert env.valid_actions == actions
        prompt = env.instruction
        assert prompt.startswith("You are an agent playing MiniHack.")
        listed = prompt.split("description of each action:\n\n")[1].split(".\n\n")[0]
        assert [line.split(": ")[0] for line in listed.split(",\n")] == actions
        assert "\nnorth: move north,\n" in prompt and prompt.endswith("\n\nPLAY!")
        goal = {"corridor": "reach the stairs down\n", "boxoban": "push the boulders onto the "
                "fountains", "quest": "fight monsters", "maze": "get as far as possible"}
        assert sum(text in prompt for word, text in goal.items() if word in task) == 1
        assert env.reset(0).startswith("inventory:\n")
    finally:
        env.close()


def test_nethack_takes_names_in_any_case_and_letters_as_written():
    env = make("nethack")
    try:
        first = env.reset(7)
        assert "Hello Agent, welcome to NetHack!" in first
        for bad in ("00", "travel", "minus", "teleport", "aa", "north east"):
            assert env.step(bad)[3]["action_is_valid"] is False, bad
        apply = env.step("a")[0]
        assert "What do you want to use or apply?" in apply or "anything to use" in apply
        env.step("esc")
        take_off_all = env.step("A")[0]
        assert "What do you want to use or apply?" not in take_off_all
        assert take_off_all != apply
        obs, _, _, info = env.step("  NORTH ")
        assert info["action_is_valid"]
        assert {"eat", "pray", "esc", "space", "0", "9", "z", "Z"} <= set(env.valid_actions)
        assert "Tips:\n- When the message asks for a completion" in env.instruction
    finally:
        env.close()


def test_more_is_paged_in_one_step():
    """Praying writes several pages; BALROG's AutoMore joins them and the agent never sees
    --More--. Without the paging the next observation would end in it."""
    env = make("nethack", show_map=False)
    try:
        env.reset(3)
        assert "Are you sure you want to pray?" in env.step("pray")[0]
        obs = env.step("y")[0]
        message = obs.split("message:\n", 1)[1].split("\n\nlanguage observation:")[0]
        assert "You begin praying to" in message and "You finish your prayer." in message
        assert "--More--" not in obs and "map:" not in obs
    finally:
        env.close()


def test_mazewalk_is_won_by_stepping_onto_the_stairs():
    """Random moves until some episodes are won: each win is the step onto the stairs the
    language observation showed adjacent in that direction; every other end is no success."""
    env = make("minihack", task="mazewalk_9x9")
    rng = np.random.default_rng(0)
    wins = 0
    try:
        for seed in range(12):
            obs, done = env.reset(seed), False
            while not done:
                move = MOVES[rng.integers(8)]
                before = obs
                obs, reward, done, info = env.step(move)
                if info["success"]:
                    assert done and reward >= 0.99 and info["progression"] == 1.0
                    assert f"stairs down adjacent {move}\n" in before + "\n"
                    wins += 1
                else:
                    assert info["progression"] == 0.0
    finally:
        env.close()
    assert wins >= 3


def test_boxoban_plays_the_shipped_levels_by_seed():
    """Each reset shows one level of the shipped files, walls, boulders and fountains where
    the file has them; the seed picks it, modulo the number of levels."""
    files = sorted((Path(__file__).parent.parent / "ragen_mega/envs/data/boxoban/hard").glob("*"))
    levels = [block.split("\n", 1)[1].strip("\n").split("\n") for path in files
              for block in path.read_text().split(";")[1:]]
    assert len(levels) == 3332
    env = make("minihack", task="boxoban_hard", show_map=True)

    def shown(seed):
        """The level on screen in the files' letters: wall #, boulder $, fountain ., floor
        blank, player @."""
        rows = env.reset(seed).split("map:\n", 1)[1].split("\n")[:21]
        walls = [(y, x) for y, row in enumerate(rows) for x, c in enumerate(row) if c == "#"]
        top, left = walls[0][0], min(x for _, x in walls)
        letters = {"#": "#", "`": "$", "{": ".", ".": " ", "@": "@"}
        return ["".join(letters[c] for c in row[left:left + 10]) for row in rows[top:top + 10]]

    try:
        screens = {seed: shown(seed) for seed in (0, 1, 3332)}
    finally:
        env.close()
    assert screens[0] in levels and screens[1] in levels
    assert screens[0] == screens[3332] and screens[0] != screens[1]


def test_nethack_progression_is_balrogs_table():
    """BALROG's values (achievements.json): the best of the levels reached, never lower."""
    env = make("nethack", show_map=False)
    try:
        env.reset(0)
        assert env.step("search")[3]["progression"] == 0.0      # Dlvl:1, Xp:1
        blstats = env._obs["blstats"]
        blstats[12], blstats[18] = 2, 3                             # depth 2, experience 3
        assert env._score(0)["progression"] == pytest.approx(0.02081163581974355)
        blstats[12], blstats[18] = 5, 1
        assert env._score(0)["progression"] == pytest.approx(0.026482449457437766)
        blstats[12] = 1
        info = env._score(0)
        assert info["progression"] == pytest.approx(0.026482449457437766)
        assert (info["max_depth"], info["max_experience_level"]) == (5, 3)
        invalid = env.step("xyzzy")[3]          # an invalid step carries the episode's too
        assert not invalid["action_is_valid"]
        assert invalid["progression"] == pytest.approx(0.026482449457437766)
    finally:
        env.close()


@pytest.mark.parametrize("name, kwargs, named", [
    ("minihack", {"task": "zork"}, "task"), ("minihack", {"task": "BabyAI-GoToLocal-v0"}, "task"),
    ("minihack", {"max_steps": 0}, "max_steps"), ("nethack", {"show_map": "yes"}, "show_map")])
def test_bad_kwargs_name_the_kwarg(name, kwargs, named):
    with pytest.raises(ValueError, match=named):
        make(name, **kwargs)


def test_served_minihack_plays_as_local(tokenizer):
    """``ragen-mega env-server minihack``: the same seeds and answers give equal samples and
    metrics on the server and in this process."""
    answers = [f" go </think><answer> {a} </answer>" for a in
               ("north", "east", "jump", "south", "west", "far east")]
    local, remote = served_and_local("minihack", {"task": "corridor_r3", "show_map": False},
                                     answers, tokenizer)
    for lo, re in zip(local, remote):
        assert re.samples == lo.samples and re.metrics == lo.metrics
    assert {e.metrics["valid_action_rate"] for e in local} - {1.0}   # "jump" is no action here
    assert [e.metrics["progression"] for e in local] == [e.metrics["success"] for e in local]
