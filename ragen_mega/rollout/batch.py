"""From played episodes to a training batch: StarPO-S filter, collate, advantages.

The three steps between rollout and trainer, kept as plain functions over :class:`Sample`
records and tensors (the math itself lives in :mod:`ragen_mega.algo`):

1. :func:`filter_groups` - StarPO-S: keep the groups whose episode rewards vary most.
2. :func:`collate` (from :mod:`.sample`) plus the per-turn fields the estimators need.
3. :func:`compute_advantages` - ``gae``: turn-level GAE over an episode's turns with critic
   values, then token-level GAE inside each turn (bi-level; for one-turn episodes this is plain
   token-level GAE); ``grpo``: episode score against its group, spread over every token.

An episode cut off by ``max_turns`` is treated as terminal, as RAGEN does; one cut by the end of
a streamed step's window (``rollout.mode: turns``) bootstraps from the critic's value of its
next state.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ragen_mega.algo.advantages import (bi_level_token_gae, broadcast_to_tokens, grpo,
                                        masked_whiten, normalize_scores, turn_level_gae)
from ragen_mega.algo.filter import select_groups
from ragen_mega.rollout.sample import Sample, collate


def episode_scores(episode_id: torch.Tensor, group_id: torch.Tensor, reward: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-turn fields -> per episode (sorted ids): ``(episode_ids, group_ids, total reward)``."""
    episode_ids, inverse = torch.unique(episode_id, return_inverse=True)
    scores = torch.zeros(len(episode_ids)).index_add_(0, inverse, reward.float())
    group_ids = torch.zeros(len(episode_ids), dtype=torch.long).index_put_((inverse,), group_id)
    return episode_ids, group_ids, scores


def _scores_of(batch: dict[str, torch.Tensor]):
    return episode_scores(batch["episode_id"], batch["group_id"], batch["reward"])


def filter_groups(samples: Sequence[Sample], ratio: float, mode: str, by_stream: bool = False
                  ) -> tuple[list[Sample], dict[str, float]]:
    """StarPO-S: the samples of the kept groups, and the filter's metrics. The filter ranks all
    groups together (as RAGEN does); a mixed-env step also reports how many groups of each env
    tag it kept (``filter/<tag>/kept_groups``), since one env can crowd out another.

    A group member's score is its episode's total reward; ``by_stream`` (``rollout.mode:
    turns``) scores each env stream instead by the reward of its turns in this step's window:
    every stream of a group played the same seeds for the same number of turns, so their window
    sums are comparable where their episodes are not (docs/design.md, "Long horizons")."""
    members = [s.stream if by_stream else s.episode_id for s in samples]
    _, group_ids, scores = episode_scores(torch.tensor(members),
                                          torch.tensor([s.group_id for s in samples]),
                                          torch.tensor([s.reward for s in samples]))
    selection = select_groups(scores, group_ids, ratio=ratio, mode=mode)
    kept = set(selection.kept_group_ids.tolist())
    metrics = {f"filter/{k}": float(v) for k, v in selection.metrics.items()}
    tags = {s.env_tag for s in samples}
    if len(tags) > 1:
        for tag in sorted(tags):
            metrics[f"filter/{tag}/kept_groups"] = float(
                len({s.group_id for s in samples if s.env_tag == tag and s.group_id in kept}))
    return [s for s in samples if s.group_id in kept], metrics


def build_batch(samples: Sequence[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """:func:`collate` plus per-sample ``reward``, ``episode_id``, ``group_id``, ``turn``,
    ``last`` (the episode's final turn, treated as terminal), ``cut`` (the step's last turn of
    an episode that goes on, ``rollout.mode: turns``)."""
    batch = collate(samples, pad_id)
    batch["reward"] = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    batch["episode_id"] = torch.tensor([s.episode_id for s in samples])
    batch["group_id"] = torch.tensor([s.group_id for s in samples])
    batch["turn"] = torch.tensor([s.turn for s in samples])
    batch["last"] = torch.tensor([s.last for s in samples])
    batch["cut"] = torch.tensor([s.cut for s in samples])
    return batch


def compute_advantages(batch: dict[str, torch.Tensor], *, estimator: str, gamma: float = 1.0,
                       lam: float = 1.0, reward_norm: str = "identity",
                       grpo_norm_by_std: bool = True, whiten: bool = False,
                       token_values: torch.Tensor | None = None,
                       bootstrap_values: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Add ``advantages`` (and for ``gae`` ``returns``) [B, S] to ``batch``; return it.

    ``token_values`` [B, S] is the critic's value of the state each token is written in (column
    t: V(tokens < t), the trainer's layout); a turn's value is the one at its first response
    token. ``gamma``/``lam``
    discount across turns; inside a turn tokens are undiscounted (Verlog's dual-discount GAE).

    ``bootstrap_values`` [B] (``gae`` only): at each cut sample (``batch["cut"]``: an episode
    that goes on past this batch) the critic's value of the state after it; the cut turn's TD
    error reads it in place of a terminal 0. Read nowhere else; None: every episode in the batch
    ends in it (episodes mode).

    ``whiten`` (``gae`` only; ``algo.whiten_advantages``): the advantages are whitened over all
    of the batch's response tokens (:func:`masked_whiten`); the returns, the critic's targets,
    are not.
    """
    mask = batch["loss_mask"]
    if estimator == "grpo":
        episode_ids, group_ids, scores = _scores_of(batch)
        scores = normalize_scores(scores, group_ids, reward_norm)
        adv = grpo(scores, group_ids, norm_by_std=grpo_norm_by_std)
        per_sample = adv[torch.searchsorted(episode_ids, batch["episode_id"])]
        batch["advantages"] = broadcast_to_tokens(per_sample, mask)
        return batch
    if estimator != "gae":
        raise ValueError(f"unknown advantage estimator {estimator!r}; allowed: gae, grpo")
    if token_values is None or token_values.shape != mask.shape:
        raise ValueError(f"gae needs critic token_values shaped like loss_mask {tuple(mask.shape)}, "
                         f"got {None if token_values is None else tuple(token_values.shape)}")
    rewards = batch["reward"]
    if reward_norm != "identity":  # normalise the episode score, carried by its last turn
        episode_ids, group_ids, scores = _scores_of(batch)
        normed = normalize_scores(scores, group_ids, reward_norm)
        delta = (normed - scores)[torch.searchsorted(episode_ids, batch["episode_id"])]
        rewards = rewards + torch.where(batch["last"], delta, torch.zeros_like(delta))
    first = batch["response_start"]
    turn_values = token_values[torch.arange(mask.shape[0]), first]
    _, turn_returns = turn_level_gae(rewards, turn_values, batch["episode_id"], batch["turn"],
                                     batch["last"], gamma_turn=gamma, lam_turn=lam,
                                     bootstrap_values=bootstrap_values)
    adv, returns = bi_level_token_gae(turn_returns, token_values, mask)
    batch["advantages"] = masked_whiten(adv, mask) if whiten else adv
    batch["returns"] = returns
    return batch

