"""What the no-LLM learning tests share: one step's played turns laid out as the rollout's batch.

The table-policy tests (``test_learn_frozen_lake_table.py``, ``test_learn_sokoban_gigpo.py``)
play a real env with a softmax table instead of a model, then train it with the project's own
estimators and PPO loss. :class:`Turns` collects what those need, one row per turn.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ragen_mega.algo.gigpo import anchor_groups


@dataclass
class Turns:
    """One step's played turns, one row each, as ``rollout/batch.py`` lays them out."""
    key: list[int]                                    # the table row the turn's answer came from
    answer: list[int]
    reward: list[float]
    episode: list[int]
    group: list[int]
    turn: list[int]
    last: list[bool]
    state: list[str]                                  # the observation the turn acted on

    @classmethod
    def empty(cls) -> "Turns":
        return cls(*([] for _ in cls.__dataclass_fields__))

    def add(self, *row) -> None:
        for column, value in zip(self.__dataclass_fields__, row):
            getattr(self, column).append(value)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The batch fields the estimators read (one token per turn: the answer)."""
        n = len(self.key)
        return {"episode_id": torch.tensor(self.episode), "group_id": torch.tensor(self.group),
                "reward": torch.tensor(self.reward, dtype=torch.float32),
                "turn": torch.tensor(self.turn), "last": torch.tensor(self.last),
                "loss_mask": torch.ones(n, 1), "response_start": torch.zeros(n, dtype=torch.long),
                "member": torch.tensor(self.episode),
                "state_group": anchor_groups(self.state, self.group)}

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """Each turn's log-probability of its answer under the table ``[n, 1]``."""
        return torch.log_softmax(logits, -1)[torch.tensor(self.key),
                                             torch.tensor(self.answer)][:, None]
