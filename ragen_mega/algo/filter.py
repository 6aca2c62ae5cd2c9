"""StarPO-S variance-based trajectory filtering (RAGEN, Wang et al. 2025, "RAGEN: Understanding
Self-Evolution in LLM Agents via Multi-Turn RL", section on StarPO-S).

Episodes are rolled out in groups that share an initial state (same env seed). A group whose
episodes all earn the same reward carries no learning signal for a group-relative estimator and
mostly adds noise; RAGEN found that keeping only the groups with the highest reward spread (the
top 25%) delays the "echo trap" collapse. ``ratio=1`` keeps every group: plain StarPO.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ragen_mega.algo.advantages import group_stats

FILTER_MODES = ("std", "std_rev")

# ratio * n_groups is floored, but 0.29 * 100 is 28.999999999999996 in floating point
_FLOOR_TOLERANCE = 1e-9


class GroupSelection(NamedTuple):
    """What :func:`select_groups` kept."""

    keep_mask: torch.Tensor  #: [n] bool, True for samples of kept groups
    kept_group_ids: torch.Tensor  #: kept group ids, ascending
    metrics: dict[str, torch.Tensor]  #: detached scalars, see :func:`select_groups`


def select_groups(rewards: torch.Tensor, group_ids: torch.Tensor, ratio: float = 0.25,
                  mode: str = "std") -> GroupSelection:
    """Keep the groups whose episode rewards vary most (``std``) or least (``std_rev``).

    ``rewards[i]`` is the total reward of episode i and ``group_ids[i]`` its group. Per group the
    unbiased std of its rewards is taken, as RAGEN does (``torch.std``); a group of one episode
    or of all-equal rewards has std 0. The number kept is ``max(1, floor(ratio * n_groups))``
    (RAGEN's ``int(value * num_groups)`` with its at-least-one guard; floored with a 1e-9
    tolerance so float error cannot drop a group). Ties are broken by ascending group id, so the
    choice is deterministic.

    For per-turn samples, pass one entry per episode and mark the turns with
    ``torch.isin(turn_group_ids, selection.kept_group_ids)``.

    Metrics: ``in_group_std`` (mean over all groups), ``chosen_in_group_std`` (mean over kept
    groups), ``kept_groups``, ``kept_ratio`` (kept / all groups).
    """
    if mode not in FILTER_MODES:
        raise ValueError(f"unknown filter mode {mode!r}; allowed: {', '.join(FILTER_MODES)}")
    if not (0.0 < ratio <= 1.0):
        raise ValueError(f"filter ratio must be in (0, 1], got {ratio}")
    if rewards.dim() != 1 or rewards.shape != group_ids.shape or rewards.numel() == 0:
        raise ValueError(f"expected equal non-empty [n] rewards and group_ids, got "
                         f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    stats = group_stats(rewards, group_ids)
    groups, stds = stats.ids, stats.std

    n_groups = groups.shape[0]
    n_keep = max(1, int(ratio * n_groups + _FLOOR_TOLERANCE))
    # stds equal up to float noise ((0.1, 0.2) vs (0.2, 0.3)) count as ties; the stable sort
    # then keeps them in ascending group-id order
    order = torch.sort(stds.round(decimals=9), descending=(mode == "std"), stable=True).indices
    chosen = torch.sort(order[:n_keep]).values
    kept_group_ids = groups[chosen]
    keep_mask = torch.isin(group_ids, kept_group_ids)
    metrics = {
        "in_group_std": stds.mean().float(),
        "chosen_in_group_std": stds[chosen].mean().float(),
        "kept_groups": torch.tensor(float(n_keep)),
        "kept_ratio": torch.tensor(n_keep / n_groups),
    }
    return GroupSelection(keep_mask, kept_group_ids, metrics)
