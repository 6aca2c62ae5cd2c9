"""The one interface every text environment implements.

An env is a text game: ``reset(seed)`` returns the first observation as text, ``step(action)``
takes the model's action text and returns ``(obs, reward, done, info)``. ``info`` always carries
``action_is_valid``, ``action_is_effective`` and ``success`` so the rollout can log RAGEN's
valid/effective action rates and success without knowing the game.

Rules every env keeps (tests check them for each registered env):
- the same seed gives the same episode, in any process (no global RNG, no unordered sets);
- any action text (empty, garbage, 100 KB, unicode) that is no action is an invalid-action
  step with ``info["action_is_valid"] = False``, never an exception; the built-in envs then
  change nothing, pay 0 and count no step;
- bad constructor kwargs raise ``ValueError``/``TypeError`` naming the kwarg.
"""
from __future__ import annotations

import abc
from typing import Any


class TextEnv(abc.ABC):
    """Base class for text environments; see the module docstring for the contract."""

    #: registry name, set by :func:`ragen_mega.envs.registry.register_env`
    name: str = ""
    #: True: every episode of a rollout group is reset with the group's seed (RAGEN's grouping).
    #: False: each member gets its own seed, for games whose episode is one random outcome (the
    #: bandit), where a shared seed would give the group one shared draw.
    seed_shared_in_group: bool = True

    @abc.abstractmethod
    def reset(self, seed: int) -> str:
        """Start a new episode fully determined by ``seed``; return the observation text."""

    @abc.abstractmethod
    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Apply one action given as text; return ``(obs, reward, done, info)``."""

    @property
    @abc.abstractmethod
    def instruction(self) -> str:
        """Game rules for the prompt: goal, symbol legend, how actions are written."""

    @property
    @abc.abstractmethod
    def valid_actions(self) -> list[str]:
        """Action words the env accepts (for the prompt); matching is case-insensitive."""

    def state_key(self, observation: str) -> str:
        """The key of the state the agent acts in, given its observation: turns of a rollout
        group with equal keys are GiGPO's anchor states (``algo.adv_estimator: gigpo``). The
        default is the observation; override it when the text holds what does not identify the
        state (a turn counter) or misses what does (hidden state)."""
        return observation

    def close(self) -> None:
        """Release resources; the default has nothing to release."""


def invalid_action_info(reason: str, **extra: Any) -> dict[str, Any]:
    """``info`` for a step whose action text could not be understood."""
    return {"action_is_valid": False, "action_is_effective": False, "success": False,
            "invalid_reason": reason, **extra}
