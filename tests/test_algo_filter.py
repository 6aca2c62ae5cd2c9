"""StarPO-S group filter: which groups survive, rounding, ties, metrics."""
from __future__ import annotations

import math

import pytest
import torch

from ragen_mega.algo.filter import select_groups

# 8 groups of 2 episodes; unbiased std of a pair (a, b) is |a - b| / sqrt(2)
PAIRS = {0: (1, 1), 1: (0, 4), 2: (0, 1), 3: (2, 2), 4: (0, 3), 5: (5, 5), 6: (0, 2), 7: (1, 1)}
# spreads |a - b|: g1 4, g4 3, g6 2, g2 1, and 0 for g0, g3, g5, g7


def _batch():
    rewards = torch.tensor([float(r) for g in PAIRS for r in PAIRS[g]])
    groups = torch.tensor([g for g in PAIRS for _ in range(2)])
    return rewards, groups


def test_keeps_top_quarter_by_std_with_mask_and_metrics():
    rewards, groups = _batch()
    sel = select_groups(rewards, groups, ratio=0.25, mode="std")
    assert sel.kept_group_ids.tolist() == [1, 4]  # floor(0.25 * 8) = 2 groups: spreads 4 and 3
    assert sel.keep_mask.tolist() == [g in (1, 4) for g in groups.tolist()]
    root2 = math.sqrt(2)
    assert sel.metrics["in_group_std"].item() == pytest.approx((4 + 3 + 2 + 1) / root2 / 8)
    assert sel.metrics["chosen_in_group_std"].item() == pytest.approx((4 + 3) / root2 / 2)
    assert sel.metrics["kept_groups"].item() == 2
    assert sel.metrics["kept_ratio"].item() == pytest.approx(0.25)


def test_std_rev_keeps_lowest_with_ties_broken_by_group_id():
    rewards, groups = _batch()
    sel = select_groups(rewards, groups, ratio=0.25, mode="std_rev")
    assert sel.kept_group_ids.tolist() == [0, 3]  # four groups tie at std 0: lowest ids win
    assert sel.metrics["chosen_in_group_std"].item() == 0.0
    sel = select_groups(rewards, groups, ratio=0.625, mode="std_rev")  # 5 groups
    assert sel.kept_group_ids.tolist() == [0, 2, 3, 5, 7]


def test_ties_in_std_mode_and_group_ids_out_of_order():
    # all groups flat except group 9; ids not sorted in the batch
    rewards = torch.tensor([1.0, 1.0, 0.0, 2.0, 3.0, 3.0, 4.0, 4.0])
    groups = torch.tensor([5, 5, 9, 9, 2, 2, 7, 7])
    sel = select_groups(rewards, groups, ratio=0.5)
    assert sel.kept_group_ids.tolist() == [2, 9]  # 9 has the spread, then the lowest tied id
    assert sel.keep_mask.tolist() == [False, False, True, True, True, True, False, False]


def test_stds_equal_up_to_float_noise_tie():
    # the pairs' stds differ in the last bits of a float64: still a tie, lowest id first
    rewards = torch.tensor([0.2, 0.3, 0.1, 0.2, 0.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    assert select_groups(rewards, groups, ratio=0.34).kept_group_ids.tolist() == [0]
    assert select_groups(rewards.flip(0), groups, ratio=0.34).kept_group_ids.tolist() == [1]


@pytest.mark.parametrize("ratio,n_groups,kept", [
    (0.3, 8, 2),     # 2.4 -> 2
    (0.1, 4, 1),     # 0.4 -> never 0 groups
    (0.29, 100, 29),  # 0.29 * 100 == 28.999999999999996 in floating point
    (0.7, 10, 7),
    (1.0, 7, 7),
])
def test_rounding_of_kept_group_count(ratio, n_groups, kept):
    groups = torch.arange(n_groups).repeat_interleave(2)
    rewards = torch.arange(2 * n_groups, dtype=torch.float32) % 3
    assert len(select_groups(rewards, groups, ratio=ratio).kept_group_ids) == kept


def test_ratio_one_is_plain_starpo_and_singletons_have_zero_std():
    rewards = torch.tensor([1.0, 0.0, 3.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 1, 2, 2])  # group 1 has one episode, group 2 is flat
    sel = select_groups(rewards, groups, ratio=1.0)
    assert sel.keep_mask.all()
    assert sel.kept_group_ids.tolist() == [0, 1, 2]
    assert sel.metrics["in_group_std"].item() == pytest.approx((1 / math.sqrt(2)) / 3)
    top = select_groups(rewards, groups, ratio=0.34)  # 1 group
    assert top.kept_group_ids.tolist() == [0]


def test_bad_arguments():
    rewards, groups = _batch()
    with pytest.raises(ValueError, match="std_rev"):
        select_groups(rewards, groups, mode="variance")
    with pytest.raises(ValueError, match="ratio"):
        select_groups(rewards, groups, ratio=0.0)
    with pytest.raises(ValueError, match="ratio"):
        select_groups(rewards, groups, ratio=1.5)
    with pytest.raises(ValueError, match="group_ids"):
        select_groups(rewards, groups[:-1])


# ------------------------------------------------- RAGEN-2's strategies, metrics and weights
# PAIRS' reward stds are spread / sqrt(2): g1 4/r2, g4 3/r2, g6 2/r2, g2 1/r2, the rest 0
R2 = math.sqrt(2)


@pytest.mark.parametrize("top_p,metric,kept", [
    # stds sum to 10/r2; 0.9 of it less 0.01 is 6.354: 4/r2 + 3/r2 = 4.950 < 6.354 <= 6.364 (+2/r2)
    (0.9, "reward_std", [1, 4, 6]),
    (0.6, "reward_std", [1, 4]),      # threshold 4.233: 4/r2 = 2.828 short, + 3/r2 reaches it
    # variances 8, 4.5, 2, 0.5 (sum 15): 0.5 -> 7.49 is met by 8 alone; 0.6 -> 8.99 needs two
    (0.5, "reward_variance", [1]),
    (0.6, "reward_variance", [1, 4]),
    (1.0, "reward_std", list(range(8))),  # top_p 1 keeps every candidate
])
def test_top_p_linear_keeps_the_fewest_groups_holding_the_mass(top_p, metric, kept):
    rewards, groups = _batch()
    sel = select_groups(rewards, groups, strategy="top_p", top_p=top_p, metric=metric)
    assert sel.kept_group_ids.tolist() == kept
    assert sel.metrics["kept_groups"].item() == len(kept)


def test_top_p_linear_keeps_nothing_when_no_group_varies():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    sel = select_groups(rewards, groups, strategy="top_p", top_p=0.9)
    assert sel.kept_group_ids.numel() == 0 and not sel.keep_mask.any()
    assert sel.metrics["kept_groups"].item() == 0 and sel.metrics["chosen_in_group_std"] == 0
    assert sel.metrics["zero_groups"].item() == 3


def test_top_p_softmax_by_probability_mass():
    rewards, groups = _batch()
    stds = [4 / R2, 3 / R2, 2 / R2, 1 / R2, 0, 0, 0, 0]  # groups 1, 4, 6, 2, then 0, 3, 5, 7
    z = sum(math.exp(s) for s in stds)
    probs = [math.exp(s) / z for s in stds]  # 0.478, 0.236, 0.116, 0.057, 0.028 x 4
    assert probs[0] < 0.7 <= probs[0] + probs[1]
    sel = select_groups(rewards, groups, strategy="top_p", top_p=0.7, top_p_mode="softmax")
    assert sel.kept_group_ids.tolist() == [1, 4]
    assert sum(probs[:3]) < 0.85 <= sum(probs[:4])
    sel = select_groups(rewards, groups, strategy="top_p", top_p=0.85, top_p_mode="softmax")
    assert sel.kept_group_ids.tolist() == [1, 2, 4, 6]
    assert sum(probs[:4]) < 0.9 <= sum(probs[:5])  # then the first flat group, lowest id
    sel = select_groups(rewards, groups, strategy="top_p", top_p=0.9, top_p_mode="softmax")
    assert sel.kept_group_ids.tolist() == [0, 1, 2, 4, 6]
    # smallest: softmax of the negated stds puts the four flat groups first (0.19 each)
    assert 1 / (4 + sum(math.exp(-s) for s in stds[:4])) < 0.3
    sel = select_groups(rewards, groups, strategy="top_p", top_p=0.3, top_p_mode="softmax",
                        mode="smallest")
    assert sel.kept_group_ids.tolist() == [0, 3]


def test_min_p_against_the_best_and_the_lowest_score():
    rewards, groups = _batch()
    # std >= 0.7 * 4/r2 = 1.98: 4/r2 and 3/r2; at 0.5 the bound is 2/r2 itself, which is kept
    assert select_groups(rewards, groups, strategy="min_p", min_p=0.7).kept_group_ids.tolist() \
        == [1, 4]
    assert select_groups(rewards, groups, strategy="min_p", min_p=0.5).kept_group_ids.tolist() \
        == [1, 4, 6]
    # group mean rewards 1, 2, .5, 2, 1.5, 5, 1, 1: smallest, min_p 0.5 keeps means <= 0.5 / 0.5
    sel = select_groups(rewards, groups, strategy="min_p", min_p=0.5, metric="reward",
                        mode="smallest")
    assert sel.kept_group_ids.tolist() == [0, 2, 6, 7]
    assert sel.metrics["score"].item() == pytest.approx(14 / 8)
    assert sel.metrics["chosen_score"].item() == pytest.approx(3.5 / 4)


def test_include_zero_false_drops_flat_groups_but_k_counts_all():
    rewards, groups = _batch()
    # floor(0.75 * 8) = 6, but only the 4 varying groups are candidates
    sel = select_groups(rewards, groups, ratio=0.75, include_zero=False)
    assert sel.kept_group_ids.tolist() == [1, 2, 4, 6]
    sel = select_groups(rewards, groups, ratio=0.75)  # with them: two flat groups, lowest ids
    assert sel.kept_group_ids.tolist() == [0, 1, 2, 3, 4, 6]
    # smallest without the flat groups: the two least varying of the rest
    sel = select_groups(rewards, groups, ratio=0.25, mode="smallest", include_zero=False)
    assert sel.kept_group_ids.tolist() == [2, 6]


def test_reward_metric_ranks_by_mean_with_ties_by_group_id():
    rewards, groups = _batch()  # means: g5 5, then g1 and g3 both 2
    sel = select_groups(rewards, groups, ratio=0.25, metric="reward", mode="largest")
    assert sel.kept_group_ids.tolist() == [1, 5]


def test_entropy_and_length_metrics_read_their_member_values():
    rewards = torch.zeros(6)
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    entropy = torch.tensor([0.5, 1.5, 2.0, 2.0, 0.1, 0.1])  # group means 1.0, 2.0, 0.1
    length = torch.tensor([10.0, 30.0, 5.0, 5.0, 50.0, 40.0])  # 20, 5, 45
    pick = dict(ratio=0.34, mode="largest", entropy=entropy, length=length)
    assert select_groups(rewards, groups, metric="entropy", **pick).kept_group_ids.tolist() == [1]
    assert select_groups(rewards, groups, metric="length", **pick).kept_group_ids.tolist() == [2]
    with pytest.raises(ValueError, match="entropy"):
        select_groups(rewards, groups, metric="entropy", mode="largest")


def test_loss_scaling_and_soft_reweighting_weights():
    rewards, groups = _batch()
    plain = select_groups(rewards, groups, ratio=0.25)
    assert plain.weights.tolist() == [1.0, 1.0]
    linear = select_groups(rewards, groups, ratio=0.25, loss_scaling="linear")
    assert linear.weights.tolist() == [0.25, 0.25]  # 2 of 8 groups kept
    # soft: each kept group's std over the largest kept one (groups 1, 4: 4/r2 and 3/r2),
    # then sqrt(2/8) = 0.5
    soft = select_groups(rewards, groups, ratio=0.25, loss_scaling="sqrt", soft_reweight=True)
    assert soft.kept_group_ids.tolist() == [1, 4]
    assert soft.weights.tolist() == pytest.approx([0.5, 0.375], abs=1e-6)


def test_bad_strategy_settings():
    rewards, groups = _batch()
    for kwargs, match in ((dict(strategy="top_q"), "top_k, top_p"),
                          (dict(metric="variance"), "reward_std"),
                          (dict(strategy="top_p", top_p=1.5), "top_p in"),
                          (dict(strategy="min_p", min_p=0.0), "min_p in"),
                          (dict(top_p_mode="cosine"), "linear, softmax"),
                          (dict(loss_scaling="log"), "none, linear, sqrt"),
                          (dict(selection_eps=-1.0), "selection_eps")):
        with pytest.raises(ValueError, match=match):
            select_groups(rewards, groups, **kwargs)
