"""A test-only env that fails on purpose (tests/test_faults.py, tests/test_env_workers.py).

Registered by the tests themselves (in the driver, or in an env worker), never in the package's
registry. What fails is chosen by kwargs, so the same env plays in the driver and in a worker.
"""
from __future__ import annotations

from ragen_mega.envs.bandit import BanditEnv

NAME = "faulty_bandit"


class FaultyBandit(BanditEnv):
    """RAGEN's bandit that raises at ``reset`` for the seeds in ``raise_at_reset``, at its first
    ``step`` for those in ``raise_at_step``, and for the seeds in ``long_seeds`` pads every
    observation with ``long_words`` words and does not end the episode at the pull (so the next
    turn's prompt, holding two observations, grows past a small model's context)."""

    def __init__(self, raise_at_reset=(), raise_at_step=(), long_seeds=(), long_words: int = 0,
                 **bandit_kwargs):
        super().__init__(**bandit_kwargs)
        self.raise_at_reset, self.raise_at_step = set(raise_at_reset), set(raise_at_step)
        self.long_seeds, self.long_words = set(long_seeds), long_words
        self.seed = None

    def reset(self, seed: int) -> str:
        if seed in self.raise_at_reset:
            raise RuntimeError(f"faulty_bandit: broken reset at seed {seed}")
        self.seed = seed
        return self._padded(super().reset(seed))

    def step(self, action: str):
        if self.seed in self.raise_at_step:
            raise RuntimeError(f"faulty_bandit: broken step at seed {self.seed}")
        obs, reward, done, info = super().step(action)
        if self.seed in self.long_seeds:
            self._done, done = False, False
        return self._padded(obs), reward, done, info

    def _padded(self, obs: str) -> str:
        return obs + " filler" * self.long_words if self.seed in self.long_seeds else obs


def register() -> None:
    """Register :class:`FaultyBandit` under ``faulty_bandit`` in this process."""
    from ragen_mega.envs import register_env

    register_env(NAME)(FaultyBandit)
