"""The losses a trainer minimises, assembled from ``algo/losses.py``: StarPO's policy objective
(the actor) and the clipped value objective (the critic), by role (:data:`OBJECTIVES`); and the
supervised warm start's (:class:`SFTObjective`, ``ragen-mega sft``).

A trainer backend computes one micro-batch's model outputs (log-probs and entropy, or values)
and hands them to its objective, which returns the loss and its statistics (verl's names where
verl has the quantity; one vector in :attr:`stat_names` order for the backend to sum, see
:meth:`Objective.stack`). Normalising over micro-batches and data-parallel ranks
(``algo/losses.py``'s module doc) is the backend's: it passes the global normaliser in
:class:`Normalization`, and token-weighted statistics are shares of the global batch's
(``global_tokens``), so they sum to its means.

``settings`` is the role's config section, so an objective's new knob is one config field.
Pure tensor functions, as the rest of ``algo/``.
"""
from __future__ import annotations

import dataclasses

import torch

from ragen_mega.algo.losses import (aggregate, episode_weighted_mask, highlight_first_tokens,
                                    kl_penalty, policy_loss, truncated_is_weights, value_loss)


def weigh_episodes(batch: dict, mode: str) -> dict:
    """``batch`` with ``episode-mean-token-mean``'s weights in its loss mask (``algo/losses.py``:
    every episode weighs alike); unchanged in the other modes. The weights come from
    ``episode_loss_tokens``, counted by the driver over the whole step's batch, so they hold
    however the rows are split into mini-batches, ranks and micro-batches."""
    if mode != "episode-mean-token-mean":
        return batch
    if "episode_loss_tokens" not in batch:
        raise KeyError("loss_agg_mode episode-mean-token-mean weighs each episode by its loss "
                       f"tokens: the batch needs episode_loss_tokens (has {sorted(batch)})")
    return {**batch, "loss_mask": episode_weighted_mask(batch["loss_mask"],
                                                        batch["episode_loss_tokens"])}


@dataclasses.dataclass(frozen=True)
class Normalization:
    """How one micro-batch's loss counts in the global batch's: ``mode`` (``loss_agg_mode``),
    the global ``normalizer`` and ``horizon`` (``algo.losses.aggregate``), and the global
    loss-token count the token-weighted statistics are shares of."""
    mode: str
    normalizer: torch.Tensor
    horizon: int
    global_tokens: torch.Tensor

    def aggregate(self, loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return aggregate(loss_mat, mask, self.mode, normalizer=self.normalizer,
                         horizon=self.horizon)


class Objective:
    """What every objective gives the backend besides its loss: the batch keys it reads, whether
    it needs the reference policy's log-probs, the batch as its loss wants it, and the step's
    metrics from the statistics summed over micro-batches and ranks."""
    needs_reference = False
    keys: tuple[str, ...] = ()
    stat_names: tuple[str, ...] = ()

    def prepare(self, batch: dict) -> dict:
        return batch

    def summarize(self, metrics: dict) -> dict:
        """The summed statistics are the batch's means as they are; an objective whose metric
        is no mean (a ratio of batch-wide moments) computes it here."""
        return metrics

    def stack(self, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """One micro-batch's statistics, given by name, as the float vector in
        :attr:`stat_names` order the backend sums over micro-batches and all-reduces."""
        if sorted(stats) != sorted(self.stat_names):
            raise KeyError(f"{type(self).__name__}: statistics {sorted(stats)} are not its "
                           f"stat_names {sorted(self.stat_names)}")
        return torch.stack([stats[name] for name in self.stat_names]).detach().float()


class PolicyObjective(Objective):
    """StarPO's actor loss on one micro-batch: the PPO clipped surrogate (asymmetric clip
    ``clip_ratio_low``/``clip_ratio_high``, dual clip ``clip_ratio_c``), optionally weighted by
    the truncated IS weight of the engine's log-probs (``tis_cap``), minus ``entropy_coeff``
    times the entropy, plus ``kl_coef`` times the KL to the reference policy (``kl_kind``).
    ``reference``: the trainer keeps the reference policy even without a KL loss (the run puts
    the KL into the reward instead: ``algo.kl_in_reward``)."""

    def __init__(self, settings, reference: bool = False):
        self.s = settings
        self.needs_reference = settings.kl_coef > 0 or reference
        self.keys = ("old_logprobs", "advantages") + (
            ("ref_logprobs",) if self.needs_reference else ()) + (
            ("rollout_logprobs",) if settings.tis_cap is not None else ())
        self.stat_names = ("loss", "pg_loss", "entropy", "kl_loss", "pg_clipfrac",
                           "pg_clipfrac_ratio_high", "pg_clipfrac_ratio_low",
                           "pg_clipfrac_lower", "ppo_kl", "ratio_mean") + (
            ("tis_weight", "tis_clipfrac") if settings.tis_cap is not None else ())

    def prepare(self, batch: dict) -> dict:
        return weigh_episodes(batch, self.s.loss_agg_mode)

    def __call__(self, outputs: dict, mb: dict, norm: Normalization
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        s, mask = self.s, mb["loss_mask"]
        logprobs, entropy = outputs["logprobs"], outputs["entropy"]
        weights = None if s.tis_cap is None else truncated_is_weights(
            mb["old_logprobs"], mb["rollout_logprobs"], s.tis_cap)
        pg, m = policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], mask,
                            s.clip_ratio_low, s.clip_ratio_high, s.clip_ratio_c, agg=norm.mode,
                            normalizer=norm.normalizer, horizon=norm.horizon, is_weights=weights)
        loss = pg
        if s.entropy_coeff:
            loss = loss - s.entropy_coeff * norm.aggregate(entropy, mask)
        kl = loss.new_zeros(())
        if s.kl_coef:
            kl = norm.aggregate(kl_penalty(logprobs, mb["ref_logprobs"], s.kl_kind), mask)
            loss = loss + s.kl_coef * kl
        with torch.no_grad():
            share = mask.sum() / norm.global_tokens  # token-weighted metric share
            stats = {"loss": loss, "pg_loss": pg,
                     "entropy": (entropy * mask).sum() / norm.global_tokens, "kl_loss": kl,
                     "pg_clipfrac": m["clip_frac"] * share,
                     "pg_clipfrac_ratio_high": m["clip_frac_upper"] * share,
                     "pg_clipfrac_ratio_low": m["clip_frac_lower"] * share,
                     "pg_clipfrac_lower": m["dual_clip_frac"] * share,
                     "ppo_kl": m["approx_kl"] * share, "ratio_mean": m["ratio_mean"] * share}
            if weights is not None:
                stats["tis_weight"] = (weights * mask).sum() / norm.global_tokens
                stats["tis_clipfrac"] = ((weights >= s.tis_cap) * mask).sum() / norm.global_tokens
            stats = self.stack(stats)
        return loss, stats


class ValueObjective(Objective):
    """The critic's clipped value loss against ``returns`` (``old_values``: the critic's values
    at rollout time; ``value_clip``), each response's first token counted ``highlight_first``
    times (Verlog's first-token weight: in the loss, its normaliser and the metrics alike).
    Metrics: ``vf_loss``, ``vf_clipfrac``, ``vpred_mean``, ``returns_mean`` and
    ``vf_explained_var`` (1 - Var(returns - values) / Var(returns) over the whole batch: 1 is a
    perfect critic, 0 or less no better than a constant), as verl and cleanrl log it."""

    keys = ("returns", "old_values")
    #: the last three are moments that :meth:`summarize` turns into ``vf_explained_var``
    stat_names = ("vf_loss", "vf_clipfrac", "vpred_mean", "returns_mean", "returns_sq_mean",
                  "vf_error_mean", "vf_error_sq_mean")

    def __init__(self, settings):
        self.s = settings

    def prepare(self, batch: dict) -> dict:
        """``batch`` with the first-token weight (and the episode weights of
        ``episode-mean-token-mean``) in its loss mask, before it is normalised."""
        batch = weigh_episodes(batch, self.s.loss_agg_mode)
        return {**batch, "loss_mask": highlight_first_tokens(batch["loss_mask"],
                                                             self.s.highlight_first)}

    def __call__(self, outputs: dict, mb: dict, norm: Normalization
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        mask = mb["loss_mask"]
        values = outputs["values"][:, :-1]  # V(tokens < t+1) predicts token t+1's return
        loss, m = value_loss(values, mb["old_values"], mb["returns"], mask, self.s.value_clip,
                             agg=norm.mode, normalizer=norm.normalizer, horizon=norm.horizon)
        with torch.no_grad():
            share = mask.sum() / norm.global_tokens
            returns, error = mb["returns"], mb["returns"] - values

            def mean(x):  # this micro-batch's share of the batch's weighted mean
                return (x * mask).sum() / norm.global_tokens
            stats = {"vf_loss": loss, "vf_clipfrac": m["vf_clip_frac"] * share,
                     "vpred_mean": m["vpred_mean"] * share, "returns_mean": mean(returns),
                     "returns_sq_mean": mean(returns.square()), "vf_error_mean": mean(error),
                     "vf_error_sq_mean": mean(error.square())}
            stats = self.stack(stats)
        return loss, stats

    def summarize(self, metrics: dict) -> dict:
        """``vf_explained_var`` from the batch's moments (a ratio of variances does not
        average over micro-batches)."""
        m = dict(metrics)
        returns_var = m.pop("returns_sq_mean") - m["returns_mean"] ** 2
        error_var = m.pop("vf_error_sq_mean") - m.pop("vf_error_mean") ** 2
        m["vf_explained_var"] = 1.0 - error_var / max(returns_var, 1e-8)
        return m


class SFTObjective(Objective):
    """Supervised fine-tuning (``ragen-mega sft``): the NLL of the target tokens (``loss_mask``:
    the assistant's), normalised as the actor's loss (:class:`Normalization`; with no episodes,
    ``episode-mean-token-mean`` is a token-mean); mean target-token entropy as a statistic."""

    stat_names = ("loss", "entropy")

    def __call__(self, outputs: dict, mb: dict, norm: Normalization
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        mask = mb["loss_mask"]
        loss = norm.aggregate(-outputs["logprobs"], mask)
        with torch.no_grad():
            entropy = (outputs["entropy"] * mask).sum() / norm.global_tokens
            stats = self.stack({"loss": loss, "entropy": entropy})
        return loss, stats


#: role -> the objective its trainer minimises
OBJECTIVES = {"actor": PolicyObjective, "critic": ValueObjective}
