"""RAGEN's two-armed bandit: one pull, then the episode is over.

One arm is low-risk (a fixed small reward), the other high-risk (a big reward with some
probability, else a small one). Arm names hint at their risk (RAGEN trains with Phoenix/Dragon
and tests with e.g. Librarian/Trader): the game measures whether a model reasons from the names
to the better expected reward. With the defaults the high-risk arm is better: 0.25 x 1.0 > 0.1.

The seed fixes the order the arms are shown in (so "1"/"2" is no fixed answer) and the high-risk
arm's draw. ``info["chose_better_arm"]`` (also ``success``, as in RAGEN) says whether the pulled
arm has the higher expected reward; with equal expectations both count as better. A short answer
(at most 64 characters) naming exactly one arm pulls it ("2. Dragon"); text naming neither or
both is an invalid-action step: reward 0, the episode goes on.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from ragen_mega.envs.base import TextEnv, invalid_action_info
from ragen_mega.envs.checks import check_seed, ensure_steppable, is_real
from ragen_mega.envs.text_actions import match_action, normalize_action, unknown_action_reason


#: answers longer than this are not read for an arm name (a ramble is not a pull)
_MAX_NAMING_CHARS = 64


class BanditEnv(TextEnv):
    """Pull one of two named arms once; see the module docstring."""

    # one pull is the whole episode: each group member needs its own draw (RAGEN offsets the seed
    # per instance), else std-normalised advantages mostly teach "the risky arm missed".
    seed_shared_in_group = False

    def __init__(self, low_risk_name: str = "Phoenix", high_risk_name: str = "Dragon",
                 low_risk_reward: float = 0.1, high_risk_reward: float = 1.0,
                 high_risk_prob: float = 0.25, high_risk_miss_reward: float = 0.0):
        """``high_risk_prob``: chance the high-risk arm pays ``high_risk_reward``; otherwise it
        pays ``high_risk_miss_reward``. The low-risk arm always pays ``low_risk_reward``."""
        for key, name in (("low_risk_name", low_risk_name), ("high_risk_name", high_risk_name)):
            if not isinstance(name, str) or normalize_action(name) in ("", "1", "2"):
                raise ValueError(f"bandit: {key} must be a non-empty name other than '1'/'2', "
                                 f"got {name!r}")
        if normalize_action(low_risk_name) == normalize_action(high_risk_name):
            raise ValueError(f"bandit: low_risk_name and high_risk_name must differ, both are "
                             f"{low_risk_name!r}")
        for key, value in (("low_risk_reward", low_risk_reward),
                           ("high_risk_reward", high_risk_reward),
                           ("high_risk_miss_reward", high_risk_miss_reward)):
            if not is_real(value):
                raise ValueError(f"bandit: {key} must be a finite number, got {value!r}")
        if not is_real(high_risk_prob) or not 0 <= high_risk_prob <= 1:
            raise ValueError(f"bandit: high_risk_prob must be in [0, 1], got {high_risk_prob!r}")
        self.low_risk_name, self.high_risk_name = low_risk_name.strip(), high_risk_name.strip()
        self.low_risk_reward = float(low_risk_reward)
        self.high_risk_reward = float(high_risk_reward)
        self.high_risk_prob = float(high_risk_prob)
        self.high_risk_miss_reward = float(high_risk_miss_reward)
        high_mean = (self.high_risk_prob * self.high_risk_reward
                     + (1 - self.high_risk_prob) * self.high_risk_miss_reward)
        self.expected_reward = {self.low_risk_name: self.low_risk_reward,
                                self.high_risk_name: high_mean}
        self._order: list[str] = []
        self._rng: np.random.Generator | None = None
        self._obs = ""
        self._done = False

    @property
    def instruction(self) -> str:
        a, b = self.low_risk_name, self.high_risk_name
        return ("You are playing a bandit game. Goal: get as much reward as you can by choosing "
                "which arm to pull; you pull exactly one arm, once.\n"
                f"There are 2 arms, named {a} and {b}. Each arm has its own reward distribution, "
                "related to its name: think about what each name symbolises to guess how its "
                "rewards behave, and pick the arm you expect to pay more on average.\n"
                f"Action: the arm's name ({a} or {b}), or its number as shown (1 or 2).")

    @property
    def valid_actions(self) -> list[str]:
        return [self.low_risk_name, self.high_risk_name]

    def reset(self, seed: int) -> str:
        self._rng = np.random.default_rng(check_seed("bandit", seed))
        self._order = list(self.valid_actions)
        if self._rng.random() < 0.5:
            self._order.reverse()
        self._done = False
        self._obs = (f"You are facing 2 slot machines: 1. {self._order[0]}, "
                     f"2. {self._order[1]}. Which machine will you pull?")
        return self._obs

    def _named_arm(self, action: Any) -> int | None:
        """Index in the shown order of the one arm a short answer names ("2. Dragon", "Dragon
        slot"), None if it names neither or both (small models rarely write the bare name)."""
        if not isinstance(action, str) or len(action) > _MAX_NAMING_CHARS or "<" in action:
            return None  # a ramble, or tags the parser should have removed: not a pull
        words = f" {' '.join(re.findall(r'[a-z0-9]+', action.lower()))} "
        named = [i for i, arm in enumerate(self._order)
                 if f" {' '.join(re.findall(r'[a-z0-9]+', arm.lower()))} " in words]
        return named[0] if len(named) == 1 else None

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        ensure_steppable("bandit", self._rng is not None, self._done)
        choices = self._order + ["1", "2"]
        index = match_action(action, [normalize_action(choice) for choice in choices])
        if index is None:
            index = self._named_arm(action)
        if index is None:
            return self._obs, 0.0, False, invalid_action_info(
                unknown_action_reason(action, choices))
        arm = self._order[index % 2]
        if arm == self.low_risk_name:
            reward = self.low_risk_reward
        elif self._rng.random() < self.high_risk_prob:
            reward = self.high_risk_reward
        else:
            reward = self.high_risk_miss_reward
        better = self.expected_reward[arm] >= max(self.expected_reward.values())
        self._done = True
        self._obs = f"You pulled {arm}: {reward:g} points."
        info = {"action_is_valid": True, "action_is_effective": True, "success": better,
                "arm": arm, "chose_better_arm": better}
        return self._obs, reward, True, info
