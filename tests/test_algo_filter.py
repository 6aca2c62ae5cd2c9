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
