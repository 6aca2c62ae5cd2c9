"""PPO losses of StarPO / StarPO-S as pure functions of ``[batch, seq]`` tensors.

Every function takes a ``mask`` (1 on tokens that carry loss, 0 on prompt, observation and
padding tokens) shaped like its inputs, and float32 tensors. Definitions follow verl's
``verl/trainer/ppo/core_algos.py`` (which RAGEN trains with) so configs and curves transfer;
where this module differs from verl it says so and why.

Aggregation across micro-batches and data-parallel ranks
--------------------------------------------------------
Per-micro-batch means do not give the global mean when micro-batches hold different numbers of
tokens (ragged multi-turn masks always do), so :func:`aggregate` divides the masked *sum* by an
optional ``normalizer``:

1. before the step, each rank computes ``loss_normalizer(mask_mb, mode)`` for each of its
   micro-batches, sums them, and all-reduces (SUM) the total over the data-parallel group;
2. each micro-batch loss is ``aggregate(loss_mat_mb, mask_mb, mode, normalizer=total)``;
3. the *sum* of these losses over all micro-batches on all ranks is exactly the full-batch loss.

Backends that average rather than sum (Megatron divides each micro-batch loss by the number of
micro-batches M; DDP averages gradients over D data-parallel ranks) must multiply the loss by
``M * D`` before backward. The tests check step 3 against the full-batch value.

Episodes alike (``episode-mean-token-mean``)
--------------------------------------------
A token-mean weighs an episode by its response tokens. In a multi-turn game the long episodes
are mostly failures (the agent wanders until ``max_turns``), so the tokens every response shares
(``</answer>``, end of turn) get a net negative advantage each step (a FrozenLake run lost its
end-of-turn token that way, ``docs/results.md``). Weighing every EPISODE alike (mean over its
response tokens, then over episodes: verl's ``seq-mean-token-mean`` when, as in RAGEN, a whole
trajectory is one sequence) makes group-mean advantages sum to zero over those shared tokens.
It holds in any layout (one row per episode or per turn, a memory window, across micro-batches
and ranks): :func:`episode_weighted_mask` puts each token's weight ``1 / (its episode's loss
tokens)`` into the loss mask before micro-batching; the mode is then a token-mean whose
normalizer (the summed weights) counts episodes.

Entropy is computed by the trainer (vocab-parallel); its bonus is
``-entropy_coeff * aggregate(entropy, mask, mode, normalizer)``, nothing more is needed here.
"""
from __future__ import annotations

from typing import Literal, get_args

import torch

AggMode = Literal["token-mean", "episode-mean-token-mean", "seq-mean-token-mean",
                  "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KlKind = Literal["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)
#: the modes that sum the (possibly weighted) loss mask: one training row per episode or one per
#: turn is the same objective under them (``rollout/packing.py``)
TOKEN_WEIGHTED: tuple[str, ...] = ("token-mean", "episode-mean-token-mean")
KL_KINDS: tuple[str, ...] = get_args(KlKind)

# log-ratios are clamped before exp, as verl does, so one wild token cannot produce inf/NaN
_LOG_RATIO_CLAMP = 20.0


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shape mismatch, all must be [batch, seq]: {shapes}")
    first = next(iter(shapes.values()))
    if len(first) != 2:
        raise ValueError(f"expected [batch, seq] tensors, got shapes {shapes}")


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; allowed: {', '.join(AGG_MODES)}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1; 0 (not NaN) when the mask is empty,
    so an all-prompt micro-batch contributes nothing instead of poisoning the step."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def episode_loss_tokens(loss_mask: torch.Tensor, episode_id: torch.Tensor) -> torch.Tensor:
    """``[B]``: the loss tokens of each row's episode over all of the batch's rows (a packed
    episode's one row, or its per-turn rows), which ``episode-mean-token-mean`` divides by."""
    per_row = loss_mask.sum(dim=-1)
    episodes, index = torch.unique(episode_id, return_inverse=True)
    totals = per_row.new_zeros(len(episodes)).index_add_(0, index, per_row)
    return totals[index]


def episode_weighted_mask(mask: torch.Tensor, episode_tokens: torch.Tensor) -> torch.Tensor:
    """The loss mask of ``episode-mean-token-mean``: each row's mask divided by its episode's
    loss tokens (:func:`episode_loss_tokens`), so an episode's weights sum to 1 wherever its
    rows go."""
    return mask / episode_tokens.to(mask.dtype).clamp(min=1)[:, None]


def loss_normalizer(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What :func:`aggregate` divides by in ``mode``, counted on this ``mask`` alone.

    Sum it over micro-batches and all-reduce it over data-parallel ranks to get the global
    normalizer (see the module docstring). ``token-mean`` counts loss tokens (the summed mask,
    which under ``episode-mean-token-mean``'s weighted mask counts episodes); the ``seq-mean-*``
    modes count sequences that have at least one loss token (an empty row is not a sample).
    """
    _check_mode(mode)
    if mode in TOKEN_WEIGHTED:
        return mask.sum()
    return (mask.sum(dim=-1) > 0).to(mask.dtype).sum()


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              normalizer: torch.Tensor | float | None = None,
              horizon: int | None = None) -> torch.Tensor:
    """Reduce a per-token loss ``[batch, seq]`` to a scalar.

    Modes (verl's ``agg_loss`` names):
      - ``token-mean``: every loss token weighs the same (DAPO's token-level loss; StarPO's
        default).
      - ``episode-mean-token-mean``: ``mask`` holds :func:`episode_weighted_mask`'s weights;
        the weighted token sum over the summed weights, i.e. the mean over episodes of each
        episode's token mean (module docstring).
      - ``seq-mean-token-mean``: mean over each sequence's tokens, then mean over sequences
        (the original GRPO objective: long answers are down-weighted per token).
      - ``seq-mean-token-sum``: sum over each sequence's tokens, then mean over sequences.
      - ``seq-mean-token-sum-norm``: Dr. GRPO (Liu et al. 2025): token sum divided by a constant
        ``horizon`` (default ``seq``; pass the configured max response length so micro-batches
        padded to different widths agree), then mean over sequences. verl never divides by the
        number of sequences, so its value grows with batch size; this one is a mean.

    ``normalizer`` replaces the local count of :func:`loss_normalizer` with the global one, so
    micro-batch losses add up to the full-batch loss. It is a count: 0 is read as 1, so an empty
    batch gives 0, never NaN. Empty rows contribute 0 in every mode.
    """
    _check_mode(mode)
    _check_same_shape(loss_mat=loss_mat, mask=mask)
    if normalizer is None:
        normalizer = loss_normalizer(mask, mode)
    if isinstance(normalizer, torch.Tensor):
        normalizer = normalizer.clamp(min=1)
    elif normalizer < 0:
        raise ValueError(f"normalizer is a token/sequence count and must be >= 0, got {normalizer}")
    else:
        normalizer = max(float(normalizer), 1.0)
    masked = loss_mat * mask
    if mode in TOKEN_WEIGHTED:
        return masked.sum() / normalizer
    token_sums = masked.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = token_sums / mask.sum(dim=-1).clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_seq = token_sums
    else:  # seq-mean-token-sum-norm
        horizon = mask.shape[-1] if horizon is None else horizon
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        per_seq = token_sums / horizon
    return per_seq.sum() / normalizer


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.28,
                clip_ratio_c: float | None = 3.0, agg: str = "token-mean",
                normalizer: torch.Tensor | float | None = None,
                horizon: int | None = None, is_weights: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with the StarPO-S / DAPO decoupled clip.

    Per token, with ``r = exp(logprobs - old_logprobs)`` and advantage ``A``::

        loss = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))

    The higher upper bound ("clip-higher", DAPO, Yu et al. 2025; StarPO-S uses 0.2 / 0.28) lets
    unlikely tokens with positive advantage grow, which keeps entropy from collapsing.

    Dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"): for
    ``A < 0`` only, the loss is capped at ``-A * clip_ratio_c``, so a token whose ratio exploded
    under a negative advantage cannot dominate the step (the upper clip bounds ``A > 0``).
    ``clip_ratio_c=None`` turns it off; verl's default is 3. Where a clip is active the loss is
    constant in ``logprobs``: zero gradient (tested).

    ``is_weights`` (:func:`truncated_is_weights`) multiply each token's clipped loss, as verl
    applies its truncated IS ratio: behaviour-policy correction for stale samples.

    Returns ``(loss, metrics)``; metrics are detached scalar tensors, token-means over ``mask``
    on this micro-batch (no ``.item()``: the caller decides when to sync and how to reduce):
      - ``clip_frac_upper``: ``A > 0`` and ``r > 1 + clip_ratio_high`` (the upper clip is active),
      - ``clip_frac_lower``: ``A < 0`` and ``r < 1 - clip_ratio_low`` (the lower clip is active),
      - ``clip_frac``: their sum (verl's ``pg_clipfrac``),
      - ``dual_clip_frac``: ``A < 0`` and the dual-clip cap is active (verl calls it
        ``pg_clipfrac_lower``),
      - ``approx_kl``: mean of ``old_logprobs - logprobs`` (k1 estimate of KL(old || new),
        verl's ``ppo_kl``),
      - ``ratio_mean``: mean importance ratio.
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                      mask=mask)
    if not (0 <= clip_ratio_low < 1):
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if clip_ratio_high < 0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1 or None, got {clip_ratio_c}")

    log_ratio = (logprobs - old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    negative = advantages < 0
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        dual_active = negative & (loss_mat > cap)
        loss_mat = torch.where(dual_active, cap, loss_mat)
    else:
        dual_active = torch.zeros_like(negative)
    if is_weights is not None:
        _check_same_shape(loss_mat=loss_mat, is_weights=is_weights)
        loss_mat = loss_mat * is_weights

    loss = aggregate(loss_mat, mask, agg, normalizer=normalizer, horizon=horizon)

    with torch.no_grad():
        upper = (advantages > 0) & (ratio > 1.0 + clip_ratio_high)
        lower = negative & (ratio < 1.0 - clip_ratio_low)
        fmask = mask.to(torch.float32)
        metrics = {
            "clip_frac_upper": masked_mean(upper.float(), fmask),
            "clip_frac_lower": masked_mean(lower.float(), fmask),
            "clip_frac": masked_mean((upper | lower).float(), fmask),
            "dual_clip_frac": masked_mean(dual_active.float(), fmask),
            "approx_kl": masked_mean(-log_ratio, fmask),
            "ratio_mean": masked_mean(ratio, fmask),
        }
    return loss, metrics


def truncated_is_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """Per-token truncated importance weights ``min(exp(old - behaviour), cap)`` (Espeholt et al.
    2018's truncation; verl's ``tis_imp_ratio_cap``, slime's ``--use-tis``), detached.

    ``behaviour_logprobs`` are the engine's at sampling time, ``old_logprobs`` the actor's
    recomputed ones (the PPO proximal policy). With stale samples (``async_mode: one_step_off``)
    they differ, and the weight turns the PPO loss back into an expectation under the policy that
    sampled. The cap bounds the variance from tokens the engine found unlikely."""
    _check_same_shape(old_logprobs=old_logprobs, behaviour_logprobs=behaviour_logprobs)
    if not cap > 0:
        raise ValueError(f"truncated IS cap must be > 0, got {cap}")
    log_ratio = (old_logprobs - behaviour_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.exp(log_ratio).clamp(max=cap).detach()


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "low_var_kl"
               ) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman 2020,
    "Approximating KL divergence", http://joschu.net/blog/kl-approx.html), verl's names:

      - ``k1`` / ``kl``: ``logprobs - ref_logprobs``; unbiased, can be negative.
      - ``abs``: ``|logprobs - ref_logprobs|``.
      - ``k2`` / ``mse``: ``0.5 * (logprobs - ref_logprobs)^2``; low variance, biased.
      - ``k3`` / ``low_var_kl``: ``exp(d) - d - 1`` with ``d = ref_logprobs - logprobs``;
        unbiased and never negative (GRPO's KL loss). ``d`` is clamped to [-20, 20] and the result
        to [-10, 10], as verl does, because the exponential is the one term that can explode.

    Returns a ``[batch, seq]`` tensor; reduce it with :func:`aggregate`.
    """
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    diff = logprobs - ref_logprobs
    if kind in ("k1", "kl"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        d = (-diff).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator kind {kind!r}; allowed: {', '.join(KL_KINDS)}")


def highlight_first_tokens(mask: torch.Tensor, weight: float) -> torch.Tensor:
    """``mask`` with every response's first loss token counted ``weight`` times (Verlog's
    ``highlight_first`` for the critic).

    Turn-level GAE reads a turn's value at its first response token, so that value decides the
    turn's credit; weighting its loss term makes the critic fit it first. A response starts where
    the mask switches on (column 0 or a 0 -> 1 step), so per-turn rows and whole-chat rows are
    both covered. As the mask of :func:`value_loss` (and of :func:`loss_normalizer`), a weighted
    token counts as ``weight`` tokens in every aggregation mode. ``weight=1`` returns ``mask``.
    """
    if not weight >= 1.0:
        raise ValueError(f"highlight weight must be >= 1, got {weight}")
    if weight == 1.0:
        return mask
    on = mask > 0
    starts = on.clone()
    starts[:, 1:] &= ~on[:, :-1]
    return torch.where(starts, mask * weight, mask.to(torch.result_type(mask, weight)))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip_range_value: float | None = 0.5, agg: str = "token-mean",
               normalizer: torch.Tensor | float | None = None,
               horizon: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss (as in OpenAI baselines' ppo2 and verl)::

        v_clip = old_values + clip(values - old_values, -clip_range_value, +clip_range_value)
        loss   = 0.5 * max((values - returns)^2, (v_clip - returns)^2)

    The max is pessimistic: the critic cannot move further than ``clip_range_value`` from its
    rollout-time value to reduce its loss. ``clip_range_value=None`` is plain 0.5 * squared
    error. Metrics (detached, token-means over ``mask``): ``vf_clip_frac`` (the clipped term is
    the larger one) and ``vpred_mean``. Explained variance is a ratio of whole-batch moments, so
    ``algo/objectives.py``'s ``ValueObjective`` computes it.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    unclipped = (values - returns).square()
    if clip_range_value is None:
        loss_mat = unclipped
        clipped_wins = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        if clip_range_value <= 0:
            raise ValueError(f"clip_range_value must be > 0 or None, got {clip_range_value}")
        v_clip = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)
        clipped = (v_clip - returns).square()
        loss_mat = torch.maximum(unclipped, clipped)
        clipped_wins = clipped > unclipped
    loss = 0.5 * aggregate(loss_mat, mask, agg, normalizer=normalizer, horizon=horizon)
    with torch.no_grad():
        fmask = mask.to(torch.float32)
        metrics = {
            "vf_clip_frac": masked_mean(clipped_wins.float(), fmask),
            "vpred_mean": masked_mean(values, fmask),
        }
    return loss, metrics
