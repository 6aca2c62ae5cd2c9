"""The contract of :class:`ragen_mega.envs.TextEnv`, checked for every registered env.

(1) the same seed gives the same episode in another process; (2) garbage action text is an
invalid-action step that changes nothing and never raises; (3) ``info`` carries the three flags;
(4) instruction and action words are non-empty text; (5) an unknown kwarg is a TypeError naming it.

Run as a script, this file prints the episode digests of every env as JSON: the tests start it
once, in a fresh process, and compare with digests computed here.
"""
from __future__ import annotations

import functools
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ragen_mega.envs import list_envs, make

SEEDS = (0, 1, 2)
SCRIPT_STEPS = 12
GARBAGE = ["", "asdf", "x" * 100_000, "日本語 🎮🐉 ✓", "<answer>up</answer>", None, "  \n\t",
           "\x00\x01", "up; rm -rf /"]
INFO_FLAGS = ("action_is_valid", "action_is_effective", "success")


def env_kwargs(name: str) -> dict:
    """Default kwargs, except a short episode for crafter (its default is 2000 steps)."""
    return {"max_steps": 50} if name == "crafter" else {}


def play(name: str, seed: int, garbage: tuple = ()) -> list:
    """Observation/reward/done/flags after reset and after each scripted action (the env's action
    words in turn), optionally trying every ``garbage`` text before each action."""
    env = make(name, **env_kwargs(name))
    try:
        trace = [env.reset(seed)]
        actions = env.valid_actions
        for i in range(SCRIPT_STEPS):
            last_obs = trace[-1] if i == 0 else trace[-1][0]
            for text in garbage:
                obs, reward, done, info = env.step(text)
                assert (obs, reward, done) == (last_obs, 0, False), f"{name}: {text[:20]!r}"
                assert [info[k] for k in INFO_FLAGS] == [False, False, False], (name, info)
            obs, reward, done, info = env.step(actions[i % len(actions)])
            trace.append([obs, float(reward), bool(done), [info[k] for k in INFO_FLAGS]])
            if done:
                break
        return trace
    finally:
        env.close()


@functools.lru_cache(maxsize=None)
def digests(name: str) -> tuple[str, ...]:
    return tuple(hashlib.sha256(json.dumps(play(name, seed), ensure_ascii=False).encode())
                 .hexdigest() for seed in SEEDS)


@pytest.fixture(scope="module")
def other_process_digests() -> dict:
    """Digests of every env computed by one fresh Python process running this file."""
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list_envs())
def test_same_seed_same_episode_in_another_process(name, other_process_digests):
    here = digests(name)
    assert list(here) == other_process_digests[name]
    assert len(set(here)) > 1, f"{name}: seeds {SEEDS} all give the same episode"


@pytest.mark.parametrize("name", list_envs())
def test_garbage_actions_are_invalid_steps_that_change_nothing(name):
    clean = play(name, SEEDS[0])
    assert play(name, SEEDS[0], garbage=tuple(GARBAGE)) == clean


@pytest.mark.parametrize("name", list_envs())
def test_info_flags_instruction_and_action_words(name):
    env = make(name, **env_kwargs(name))
    try:
        assert isinstance(env.instruction, str) and env.instruction.strip()
        actions = env.valid_actions
        assert isinstance(actions, list) and actions
        assert all(isinstance(a, str) and a.strip() for a in actions)
        env.reset(SEEDS[0])
        obs, reward, done, info = env.step(actions[0])
        assert isinstance(obs, str) and isinstance(done, bool)
        assert isinstance(reward, (int, float)) and not isinstance(reward, bool)
        assert all(type(info[k]) is bool for k in INFO_FLAGS), info
        assert info["action_is_valid"] is True
    finally:
        env.close()


@pytest.mark.parametrize("name", list_envs())
def test_unknown_kwarg_is_a_type_error_naming_it(name):
    with pytest.raises(TypeError, match="no_such_kwarg"):
        make(name, no_such_kwarg=1)


if __name__ == "__main__":
    result = {}
    for env_name in list_envs():
        try:
            result[env_name] = list(digests(env_name))
        except Exception as err:  # reported per env; the test names the failing env
            result[env_name] = f"{type(err).__name__}: {err}"
    print(json.dumps(result))
