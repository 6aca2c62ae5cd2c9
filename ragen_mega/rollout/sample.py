"""The one record that carries a turn from the engine to the trainer, and its batch form.

Each turn of an episode is one :class:`Sample` (docs/design.md, "Long horizons"): the prompt ids the
engine was given, the response ids it sampled and their log-probs, exactly as sampled
(token-in/token-out: nothing is re-tokenized), the turn's reward, and where the turn belongs
(episode, group of episodes sharing a seed, turn number). The trainer's batch is built from these
records by :func:`collate` and never from text.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch


@dataclasses.dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]     # one per response token, from the engine
    reward: float                     # this turn: env rewards of its actions + format penalty
    episode_id: int
    group_id: int                     # episodes of one group share the env seed (RAGEN grouping)
    turn: int                         # 1-based
    done: bool                        # the episode ended in this turn (False: not, or truncated)
    last: bool                        # this is the episode's final recorded turn
    env_tag: str
    seed: int
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: ``rollout.mode: turns``: the engines' weights it was sampled with (the trainer step that
    #: made them), the env stream that played it, and whether it is the step's last turn of an
    #: episode that goes on (its advantage bootstraps from the next state's value)
    weight_version: int = 0
    stream: int | None = None
    cut: bool = False

    def __post_init__(self):
        if len(self.rollout_logprobs) != len(self.response_ids):
            raise ValueError(f"Sample: {len(self.response_ids)} response ids but "
                             f"{len(self.rollout_logprobs)} rollout log-probs")


def collate(samples: Sequence[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded training batch of ``prompt + response`` per sample.

    Every field is [B, S] and column t belongs to token t (the trainer's layout: a per-token value
    of token t is computed from the tokens before it; column 0 is never a loss token):
    ``input_ids``, ``attention_mask``, ``loss_mask`` (1 exactly on the model-written tokens),
    ``rollout_logprobs`` (the engine's log-prob of each written token). ``response_start`` [B]
    is each sample's first response column.
    """
    if not samples:
        raise ValueError("collate: no samples")
    seq = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, seq), pad_id, dtype=torch.long)
    attention = torch.zeros(b, seq, dtype=torch.long)
    loss_mask = torch.zeros(b, seq, dtype=torch.float32)
    logprobs = torch.zeros(b, seq, dtype=torch.float32)
    for i, s in enumerate(samples):
        if not s.prompt_ids:
            raise ValueError(f"collate: sample {i} (episode {s.episode_id}, turn {s.turn}) has an "
                             f"empty prompt")
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, :p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attention[i, :p + r] = 1
        loss_mask[i, p:p + r] = 1.0
        logprobs[i, p:p + r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask,
            "rollout_logprobs": logprobs,
            "response_start": torch.tensor([len(s.prompt_ids) for s in samples])}
