"""Bandit: payouts follow the configured distributions (binomial tolerance over many seeds), the
better arm is the one with the higher expected reward, names and numbers both work."""
from __future__ import annotations

import re

import pytest

from ragen_mega.envs import make


def shown_order(obs: str) -> list[str]:
    match = re.search(r"1\. (\S+), 2\. (\S+)\.", obs)
    assert match, obs
    return [match.group(1), match.group(2)]


def within_binomial(hits: int, n: int, prob: float) -> bool:
    sigma = (n * prob * (1 - prob)) ** 0.5
    return abs(hits - n * prob) <= max(4.5 * sigma, 0.5)


@pytest.mark.parametrize("kwargs,low,high", [
    ({}, "Phoenix", "Dragon"),
    ({"low_risk_name": "Librarian", "high_risk_name": "Trader", "low_risk_reward": 0.5,
      "high_risk_reward": 2.0, "high_risk_prob": 0.7, "high_risk_miss_reward": -1.0},
     "Librarian", "Trader"),
])
def test_payouts_follow_the_configured_distributions(kwargs, low, high):
    low_reward = kwargs.get("low_risk_reward", 0.1)
    hit, miss = kwargs.get("high_risk_reward", 1.0), kwargs.get("high_risk_miss_reward", 0.0)
    prob = kwargs.get("high_risk_prob", 0.25)
    env = make("bandit", **kwargs)
    assert low in env.instruction and high in env.instruction
    n, hits, first_shown = 4000, 0, 0
    for seed in range(n):
        obs = env.reset(seed)
        first_shown += shown_order(obs)[0] == high
        _, reward, done, info = env.step(high)
        assert done and info["arm"] == high and reward in (hit, miss)
        hits += reward == hit
        env.reset(seed)
        _, reward, _, info = env.step(low.upper())
        assert (reward, info["arm"]) == (low_reward, low)
    assert within_binomial(hits, n, prob)
    assert within_binomial(first_shown, n, 0.5)  # the shown order is a fair coin per seed


@pytest.mark.parametrize("prob,better", [(0.25, "Dragon"), (0.05, "Phoenix"), (0.1, "both")])
def test_better_arm_is_the_higher_expected_reward(prob, better):
    # expected rewards: Phoenix 0.1, Dragon prob x 1.0
    env = make("bandit", high_risk_prob=prob)
    for arm in ("Phoenix", "Dragon"):
        env.reset(0)
        info = env.step(arm)[3]
        assert info["chose_better_arm"] == info["success"] == (better in (arm, "both"))


def test_numbers_pick_the_arm_in_the_shown_order():
    env = make("bandit")
    for seed in range(10):
        for number in ("1", "2"):
            order = shown_order(env.reset(seed))
            assert env.step(f" {number} ")[3]["arm"] == order[int(number) - 1]


def test_short_answers_naming_one_arm_pull_it():
    env = make("bandit", low_risk_name="Teacher", high_risk_name="Trader")
    for text, arm in [("2. Trader", "Trader"), ("Trader slot", "Trader"), ("[teacher].", "Teacher"),
                      ("  TEACHER!", "Teacher")]:
        env.reset(1)
        obs, _, done, info = env.step(text)
        assert info["action_is_valid"] and info["arm"] == arm and done, text
    for text in ("Teacher or Trader", "Traders", "I would pull the trader " + "x" * 60):
        env.reset(1)
        assert env.step(text)[3]["action_is_valid"] is False, text


def test_invalid_actions_step_limits_and_bad_kwargs():
    env = make("bandit", low_risk_name="Teacher", high_risk_name="Trader")
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Trader")
    obs = env.reset(5)
    for garbage in ["", "3", "Dragon", "Trader Teacher", None, "x" * 100_000, "🐉",
                    "<answer>Trader</answer>"]:
        assert env.step(garbage)[:3] == (obs, 0.0, False)
        assert env.step(garbage)[3]["action_is_valid"] is False
    env.step("trader")
    with pytest.raises(RuntimeError, match="done"):
        env.step("Trader")
    for kwargs, name in [({"low_risk_name": ""}, "low_risk_name"),
                         ({"high_risk_name": "2"}, "high_risk_name"),
                         ({"high_risk_name": "phoenix"}, "differ"),
                         ({"high_risk_prob": 1.5}, "high_risk_prob"),
                         ({"low_risk_reward": float("nan")}, "low_risk_reward"),
                         ({"high_risk_reward": "1"}, "high_risk_reward")]:
        with pytest.raises(ValueError, match=name):
            make("bandit", **kwargs)
