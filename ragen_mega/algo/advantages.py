"""Advantage estimators for StarPO (token-level GAE, GRPO, RAGEN's score normalisation) and for
long horizons, where each turn is its own training sample (turn-level / bi-level GAE).

Pure tensor math, no gradients: advantages and returns are regression targets, so every function
runs under ``torch.no_grad()``. Token tensors are ``[batch, seq]`` with a ``mask`` that is 1 on the
tokens the policy generated (the loss tokens) and 0 on prompt, observation and padding tokens.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

NORM_METHODS = ("identity", "mean", "mean_std", "asym_clip")

# RAGEN treats a group as constant (normalised score 0) when its std is at or below this
_RAGEN_STD_FLOOR = 1e-6


def _check_tokens(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"expected equal [batch, seq] shapes, got {shapes}")


def _check_samples(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"expected equal one-dimensional [batch] shapes, got {shapes}")


@torch.no_grad()
def _masked_gae_scan(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     gamma: float, lam: float, bootstrap: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) along the last dim of ``[rows, steps]`` over the positions
    where ``mask`` is set; a masked-out position is skipped entirely (reward and value unread, no
    discount step). ``bootstrap[row]`` is the value after the row's last valid position (0 for a
    terminal state). Returns ``(advantages, returns)``, 0 where masked.
    """
    keep = mask.bool()
    next_value = bootstrap.to(values.dtype)
    next_adv = torch.zeros_like(next_value)
    advantages = torch.zeros_like(values)
    for t in range(values.shape[-1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        m = keep[:, t]
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, adv, next_adv)
        advantages[:, t] = torch.where(m, adv, torch.zeros_like(adv))
    returns = torch.where(keep, advantages + values, torch.zeros_like(values))
    return advantages, returns


@torch.no_grad()
def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
        gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE over the loss tokens of each row; returns ``(advantages, returns)``.

    As verl's ``compute_gae_advantage_return`` (which RAGEN uses with its loss mask), the
    recursion skips masked positions: observation tokens are not MDP steps, so turn k's last
    token bootstraps from the value at turn k+1's first token, and ``gamma`` discounts once per
    generated token. ``values[:, t]`` is the critic's value of the state token t is generated in.
    The row's last loss token is terminal (next value 0).

    A reward on a masked position would be silently dropped, so it raises: put each turn's reward
    on its last generated token. No whitening (verl whitens inside; here the caller does, see
    :func:`masked_whiten`).
    """
    _check_tokens(token_rewards=token_rewards, values=values, mask=mask)
    off_mask = (token_rewards != 0) & ~mask.bool()
    if off_mask.any():
        rows = torch.nonzero(off_mask.any(dim=-1)).flatten().tolist()
        raise ValueError(f"token_rewards has non-zero rewards on masked (non-loss) positions in "
                         f"rows {rows[:10]}; GAE would drop them - put rewards on loss tokens")
    bootstrap = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    return _masked_gae_scan(token_rewards, values, mask, gamma, lam, bootstrap)


@torch.no_grad()
def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``values`` to unit variance (and zero mean if ``shift_mean``) over the masked
    positions, with the unbiased variance, as verl's ``masked_whiten`` does to GAE advantages.
    Masked positions come back 0."""
    _check_tokens(values=values, mask=mask)
    m = mask.to(values.dtype)
    n = m.sum()
    if n < 2:
        raise ValueError(f"masked_whiten needs at least 2 masked positions, got {int(n)}")
    mean = (values * m).sum() / n
    var = ((values - mean).square() * m).sum() / (n - 1)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * m


@torch.no_grad()
def advantage_metrics(advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's ``critic/advantages/{mean,max,min}`` over the loss tokens (none: no scalars).

    The mean is the net push a ``token-mean`` loss gives each trained token. Group-relative
    advantages sum to 0 over episodes, not tokens: when failed episodes are the long ones, the
    mean stays below 0 and what every answer shares (its end, its commonest move) is pushed down.
    """
    _check_tokens(advantages=advantages, mask=mask)
    trained = advantages[mask.bool()]
    if trained.numel() == 0:
        return {}
    return {"critic/advantages/mean": float(trained.mean()),
            "critic/advantages/max": float(trained.max()),
            "critic/advantages/min": float(trained.min())}


class GroupStats(NamedTuple):
    """Statistics of ``scores`` per group; groups in ascending id order."""

    ids: torch.Tensor  #: [n_groups] the distinct group ids, ascending
    inverse: torch.Tensor  #: [n] index of each sample's group in ``ids``
    mean: torch.Tensor  #: [n_groups] float64
    std: torch.Tensor  #: [n_groups] float64, unbiased (``torch.std``), 0 for a group of one
    count: torch.Tensor  #: [n_groups] float64


def group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> GroupStats:
    """Mean, unbiased std and size of ``scores`` within each group of ``group_ids`` (float64, so
    large groups of float32 rewards lose nothing)."""
    _check_samples(scores=scores, group_ids=group_ids)
    if scores.numel() == 0:
        raise ValueError("scores is empty")
    ids, inverse = torch.unique(group_ids, return_inverse=True)
    x = scores.to(torch.float64)
    count = torch.bincount(inverse).to(torch.float64)
    mean = torch.bincount(inverse, weights=x) / count
    sq_dev = torch.bincount(inverse, weights=(x - mean[inverse]).square())
    std = torch.where(count > 1, (sq_dev / (count - 1).clamp(min=1)).sqrt(),
                      torch.zeros_like(sq_dev))
    return GroupStats(ids, inverse, mean, std, count)


def _per_sample_stats(scores: torch.Tensor, group_ids: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: its group's mean and std (in ``scores``' dtype) and size."""
    stats = group_stats(scores, group_ids)
    i = stats.inverse
    return (stats.mean[i].to(scores.dtype), stats.std[i].to(scores.dtype), stats.count[i])


@torch.no_grad()
def grpo(scores: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True,
         eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath): per sample
    ``(score - group mean) / (group std + eps)``, std unbiased like ``torch.std`` and verl;
    ``norm_by_std=False`` is Dr. GRPO (Liu et al. 2025), mean subtraction only.

    A group of one sample gets advantage 0: it has no baseline. (verl uses mean 0 / std 1 there,
    turning a lone sample's raw score into a full-strength advantage.) Returns ``[batch]``; spread
    it over tokens with :func:`broadcast_to_tokens`.
    """
    mean, std, count = _per_sample_stats(scores, group_ids)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


@torch.no_grad()
def normalize_scores(scores: torch.Tensor, group_ids: torch.Tensor, method: str = "identity"
                     ) -> torch.Tensor:
    """RAGEN's episode-score normalisation (``agent_proxy.reward_normalization`` in its
    ``ctx_manager``), before the advantage estimator, within ``group_ids`` (same env seed:
    RAGEN's ``state`` grouping; its ``batch`` and ``inductive`` groupings are not used by any
    config, so not here). ``method``:
      - ``identity``: unchanged,
      - ``mean``: subtract the group mean,
      - ``mean_std``: ``(x - mean) / (std + 1e-6)``, and 0 for a group whose std <= 1e-6
        (RAGEN's guard: an all-equal group carries no signal and dividing would amplify noise),
      - ``asym_clip``: ``mean_std`` clamped to [-1, 3] (keeps rare successes, bounds failures).
    Std is unbiased, as in RAGEN. A group of one sample gets 0 under every method but identity;
    RAGEN instead skips normalisation when *every* group has one sample (not copied here).
    """
    if method not in NORM_METHODS:
        raise ValueError(f"unknown reward normalization method {method!r}; "
                         f"allowed: {', '.join(NORM_METHODS)}")
    _check_samples(scores=scores, group_ids=group_ids)
    if method == "identity":
        return scores.clone()
    mean, std, count = _per_sample_stats(scores, group_ids)
    if method == "mean":
        out = scores - mean
    else:
        out = torch.where(std > _RAGEN_STD_FLOOR, (scores - mean) / (std + _RAGEN_STD_FLOOR),
                          torch.zeros_like(scores))
        if method == "asym_clip":
            out = out.clamp(-1.0, 3.0)
    return torch.where(count > 1, out, torch.zeros_like(out))


def episode_scores(episode_id: torch.Tensor, group_id: torch.Tensor, reward: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-turn fields -> per episode (sorted ids): ``(episode_ids, group_ids, total reward)``."""
    episode_ids, inverse = torch.unique(episode_id, return_inverse=True)
    scores = torch.zeros(len(episode_ids)).index_add_(0, inverse, reward.float())
    group_ids = torch.zeros(len(episode_ids), dtype=torch.long).index_put_((inverse,), group_id)
    return episode_ids, group_ids, scores


def kl_penalized_rewards(rewards: torch.Tensor, token_kl: torch.Tensor, mask: torch.Tensor,
                         coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """KL in the reward (verl's ``use_kl_in_reward``, which Verlog turns on for long horizons):
    each turn's reward less ``coef`` times the sum of its response tokens' KL to the reference
    (``token_kl`` [B, S], the ``mask``ed tokens counted). Returns ``(rewards, turn_kl)`` [B].
    verl puts the KL on each token's reward; here a turn is the unit of reward (the estimators
    spread it over the turn's tokens), so the turn gets its tokens' sum."""
    if rewards.dim() != 1 or token_kl.shape != mask.shape or token_kl.shape[0] != rewards.shape[0]:
        raise ValueError(f"expected rewards [B] and token_kl, mask [B, S], got "
                         f"{tuple(rewards.shape)}, {tuple(token_kl.shape)}, {tuple(mask.shape)}")
    turn_kl = (token_kl * mask.to(token_kl.dtype)).sum(dim=1).to(rewards.dtype)
    return rewards - coef * turn_kl, turn_kl


def broadcast_to_tokens(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every loss token of row i the value ``per_sample[i]`` (0 elsewhere): how a
    sequence-level advantage (GRPO, turn-level GAE) becomes a token-level one."""
    if per_sample.dim() != 1 or mask.dim() != 2 or per_sample.shape[0] != mask.shape[0]:
        raise ValueError(f"expected per_sample [batch] and mask [batch, seq], got "
                         f"{tuple(per_sample.shape)} and {tuple(mask.shape)}")
    return per_sample[:, None] * mask.to(per_sample.dtype)


def _episode_layout(episode_ids: torch.Tensor, turn_indices: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each turn's (row, column) in a ``[n_episodes, max_turns]`` grid (column: turn index minus
    the episode's first in the batch) and each row's last column. An episode's turns must be
    unique and consecutive (a window of an episode, as in Verlog's fixed-turn batching, is fine)."""
    episodes, row = torch.unique(episode_ids, return_inverse=True)
    n_rows = episodes.shape[0]
    turns = turn_indices.to(torch.int64)
    first = torch.full((n_rows,), torch.iinfo(torch.int64).max, dtype=torch.int64,
                       device=turns.device).scatter_reduce(0, row, turns, reduce="amin")
    col = turns - first[row]
    last_col = torch.zeros(n_rows, dtype=torch.int64, device=turns.device).scatter_reduce(
        0, row, col, reduce="amax")
    n_cols = int(last_col.max()) + 1
    occupancy = torch.zeros(n_rows * n_cols, dtype=torch.int64, device=turns.device)
    occupancy.index_add_(0, row * n_cols + col, torch.ones_like(col))
    occupancy = occupancy.view(n_rows, n_cols)
    broken = (occupancy.max(dim=1).values > 1) | (occupancy.sum(dim=1) != last_col + 1)
    if broken.any():
        raise ValueError(f"episodes {episodes[broken].tolist()[:10]} have repeated or "
                         f"non-consecutive turn_indices; each episode's turns must be unique "
                         f"and consecutive")
    return row, col, last_col


@torch.no_grad()
def turn_level_gae(rewards: torch.Tensor, values: torch.Tensor, episode_ids: torch.Tensor,
                   turn_indices: torch.Tensor, dones: torch.Tensor, gamma_turn: float = 1.0,
                   lam_turn: float = 1.0, bootstrap_values: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over turns, for batches where every turn is its own sample; returns per-turn
    ``(advantages, returns)`` ``[n_turns]``, in the input order.

    The turn is the MDP step (the "high level" of ArCHer, Zhou et al. 2024, and of RAGEN's /
    VAGEN's bi-level GAE; the step-level discount of Verlog's dual-discount GAE, whose defaults
    are gamma_turn=0.99, lam_turn=0.95). For turn k of an episode::

        delta_k = rewards_k + gamma_turn * V_{k+1} - V_k
        A_k     = delta_k + gamma_turn * lam_turn * A_{k+1},      returns_k = A_k + V_k

    ``values[k]`` is the critic's value at the turn's first generated token. Samples may come in
    any order; turns are matched by ``episode_ids`` and ordered by ``turn_indices``. An episode's
    last turn in the batch is terminal (``dones`` True: next V is 0) or truncated (the episode
    goes on past the batch, as in Verlog's fixed-turn batching); then ``bootstrap_values`` at that
    turn, and only there, must hold V of the next state (at the end of the next turn's prompt).
    A ``done`` before an episode's last turn is an error.
    """
    _check_samples(rewards=rewards, values=values, episode_ids=episode_ids,
                   turn_indices=turn_indices, dones=dones)
    if bootstrap_values is not None:
        _check_samples(rewards=rewards, bootstrap_values=bootstrap_values)
    row, col, last_col = _episode_layout(episode_ids, turn_indices)
    is_last = col == last_col[row]
    done = dones.bool()
    if (done & ~is_last).any():
        bad = sorted({int(e) for e in episode_ids[done & ~is_last].tolist()})
        raise ValueError(f"episodes {bad[:10]} have dones=True before their last turn")
    truncated_last = is_last & ~done
    if truncated_last.any() and bootstrap_values is None:
        bad = sorted({int(e) for e in episode_ids[truncated_last].tolist()})
        raise ValueError(f"episodes {bad[:10]} end without dones=True (truncated): pass "
                         f"bootstrap_values with V(next state) at their last turn")

    n_rows, n_cols = last_col.shape[0], int(last_col.max()) + 1
    grid = values.new_zeros(n_rows, n_cols)
    grid_rewards = grid.index_put((row, col), rewards.to(values.dtype))
    grid_values = grid.index_put((row, col), values)
    grid_mask = grid.bool().index_put((row, col), torch.ones_like(row, dtype=torch.bool))
    bootstrap = values.new_zeros(n_rows)
    if truncated_last.any():
        bootstrap[row[truncated_last]] = bootstrap_values[truncated_last].to(values.dtype)
    adv, ret = _masked_gae_scan(grid_rewards, grid_values, grid_mask, gamma_turn, lam_turn,
                                bootstrap)
    return adv[row, col], ret[row, col]


@torch.no_grad()
def bi_level_token_gae(turn_returns: torch.Tensor, token_values: torch.Tensor,
                       mask: torch.Tensor, gamma_token: float = 1.0, lam_token: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE inside each turn, driven by the turn-level return (the "low level" of
    bi-level GAE: ArCHer, Zhou et al. 2024; RAGEN/VAGEN ``compute_bi_level_gae_advantage_return``).

    Row i is one turn: its last loss token receives ``turn_returns[i]`` (from
    :func:`turn_level_gae`) as a terminal reward and GAE runs back over the turn's loss tokens
    with ``gamma_token`` / ``lam_token``. Returns ``(advantages, returns)`` ``[batch, seq]``; a
    row without loss tokens gets zeros.

    With ``gamma_token = lam_token = 1`` (Verlog's defaults) token t gets
    ``turn_returns[i] - token_values[i, t]`` (the first token: the turn-level advantage), which
    is exactly Verlog's dual-discount GAE over the episode's tokens (tested against a naive
    implementation of its recursion).
    """
    _check_tokens(token_values=token_values, mask=mask)
    if turn_returns.shape != (mask.shape[0],):
        raise ValueError(f"turn_returns must be [batch]={mask.shape[0]}, "
                         f"got {tuple(turn_returns.shape)}")
    keep = mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(keep, positions, torch.full_like(positions, -1)).max(dim=-1).values
    rows = torch.nonzero(last >= 0).flatten()
    token_rewards = torch.zeros_like(token_values)
    token_rewards[rows, last[rows]] = turn_returns[rows].to(token_values.dtype)
    return gae(token_rewards, token_values, mask, gamma_token, lam_token)
