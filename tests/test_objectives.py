"""The trainer's objectives (``algo/objectives.py``) summed over micro-batches, as the backend
sums them, against the loss functions on the whole batch at once: the statistics that are means
add up, and the critic's explained variance, which is no mean, comes out of the summed moments
equal to the whole batch's. Pure tensors: no Megatron, no Ray."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ragen_mega.algo.losses import policy_loss, value_loss
from ragen_mega.algo.objectives import Normalization, PolicyObjective, ValueObjective

ROWS, COLS = 6, 7


def split_sum(objective, outputs, batch, cuts=(2, 6)):
    """The objective's statistics summed over the micro-batches ``[0, 2)`` and ``[2, 6)``,
    normalised by the whole batch (as the backend does), then summarized."""
    mask = batch["loss_mask"]
    norm = Normalization("token-mean", mask.sum(), COLS, mask.sum())
    total, start = None, 0
    for end in cuts:
        part = {k: v[start:end] for k, v in batch.items()}
        out = {k: v[start:end] for k, v in outputs.items()}
        _, stats = objective(out, part, norm)
        total = stats if total is None else total + stats
        start = end
    return objective.summarize(dict(zip(objective.stat_names, total.tolist())))


def test_critic_metrics_over_micro_batches_equal_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(ROWS, COLS, generator=g) > 0.3).float()
    returns = torch.rand(ROWS, COLS, generator=g) * 2
    values = returns + 0.4 * torch.randn(ROWS, COLS + 1, generator=g)[:, :-1]  # a fair critic
    batch = {"loss_mask": mask, "returns": returns, "old_values": values.detach() + 0.1}
    outputs = {"values": torch.cat([values, torch.zeros(ROWS, 1)], dim=1)}
    settings = SimpleNamespace(value_clip=0.2, loss_agg_mode="token-mean", highlight_first=1)
    metrics = split_sum(ValueObjective(settings), outputs, batch)
    _, whole = value_loss(values, batch["old_values"], returns, mask, 0.2)

    def var(x):  # over the whole batch's loss tokens, by hand
        mean = (x * mask).sum() / mask.sum()
        return ((x - mean).square() * mask).sum() / mask.sum()
    explained = 1.0 - var(returns - values) / var(returns)
    assert 0.3 < explained < 0.99  # neither trivial nor perfect
    assert abs(metrics["vf_explained_var"] - explained.item()) < 1e-5
    assert abs(metrics["vpred_mean"] - whole["vpred_mean"].item()) < 1e-5
    assert abs(metrics["returns_mean"] - (returns * mask).sum().item() / mask.sum().item()) < 1e-5
    assert set(metrics) == {"vf_loss", "vf_clipfrac", "vpred_mean", "returns_mean",
                            "vf_explained_var"}  # the moments do not reach the logs


def test_critic_explained_variance_perfect_and_constant():
    """1 for a perfect critic, 0 for one that predicts the mean return everywhere."""
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]]).repeat(ROWS, 1)
    mask = torch.ones_like(returns)
    settings = SimpleNamespace(value_clip=None, loss_agg_mode="token-mean", highlight_first=1)
    for values, expected in ((returns, 1.0), (torch.full_like(returns, 2.5), 0.0)):
        batch = {"loss_mask": mask, "returns": returns, "old_values": values}
        outputs = {"values": torch.cat([values, torch.zeros(ROWS, 1)], dim=1)}
        metrics = split_sum(ValueObjective(settings), outputs, batch)
        assert abs(metrics["vf_explained_var"] - expected) < 1e-6


def test_stats_are_stacked_by_name():
    """A statistic the objective does not name (or one it names but lacks) is an error, not a
    value under a neighbour's name."""
    objective = ValueObjective(SimpleNamespace(value_clip=None, loss_agg_mode="token-mean",
                                               highlight_first=1))
    stats = {name: torch.tensor(float(i)) for i, name in enumerate(objective.stat_names)}
    assert objective.stack(stats).tolist() == list(range(len(objective.stat_names)))
    with pytest.raises(KeyError, match="stat_names"):
        objective.stack({**stats, "extra": torch.tensor(0.0)})


def test_actor_ratio_mean_over_micro_batches_equals_the_whole_batch():
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(ROWS, COLS, generator=g) > 0.3).float()
    old = -torch.rand(ROWS, COLS, generator=g) * 3
    new = old + 0.1 + 0.3 * torch.randn(ROWS, COLS, generator=g)  # the policy moved up
    advantages = torch.randn(ROWS, COLS, generator=g)
    batch = {"loss_mask": mask, "old_logprobs": old, "advantages": advantages}
    outputs = {"logprobs": new, "entropy": torch.rand(ROWS, COLS, generator=g)}
    settings = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                               tis_cap=None, kl_coef=0.0, entropy_coeff=0.0,
                               loss_agg_mode="token-mean", kl_kind="low_var_kl")
    metrics = split_sum(PolicyObjective(settings), outputs, batch)
    _, whole = policy_loss(new, old, advantages, mask, 0.2, 0.28, 3.0)
    ratio = (torch.exp(new - old) * mask).sum() / mask.sum()  # by hand
    assert abs(ratio.item() - 1.0) > 0.01
    assert abs(metrics["ratio_mean"] - ratio.item()) < 1e-5
    assert abs(metrics["ratio_mean"] - whole["ratio_mean"].item()) < 1e-5
    assert abs(metrics["ppo_kl"] - whole["approx_kl"].item()) < 1e-5
