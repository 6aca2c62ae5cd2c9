"""Rollout group filtering: StarPO-S (RAGEN, Wang et al. 2025, section on StarPO-S) and RAGEN-2's
generalisation of it ("Reasoning Collapse in Agentic RL", arXiv 2604.06268; RAGEN's
``ragen/trainer/rollout_filter.py`` and ``docs/rollout_filtering.md``).

A group's episodes share an initial state (same env seed). A group whose episodes all earn the
same reward gives a group-relative estimator no signal, only noise; RAGEN found that keeping the
groups with the highest reward spread (top 25%) delays the "echo trap" collapse. ``ratio=1``
keeps every group: plain StarPO.

RAGEN-2 generalises the cut. Each group gets a score (``metric``, one of :data:`GROUP_METRICS`)
and a ``strategy`` (one of :data:`STRATEGIES`) picks groups by it:

- ``top_k``: the top ``ratio`` of all groups (StarPO-S; at least one).
- ``top_p``: by mass. ``linear``: the fewest top groups whose scores add up to ``top_p`` of
  the candidates' total, less ``selection_eps`` (none at all when they cannot: all candidates
  score 0, so the step has nothing to learn from); ``softmax``: the fewest top groups whose
  softmax probabilities add up to ``top_p`` (at least one). ``top_p=1`` keeps every candidate.
- ``min_p``: every group scoring at least ``min_p`` times the best score (``smallest``: at most
  the lowest score over ``min_p``).

``include_zero=False`` drops the groups scoring 0 before the strategy runs (RAGEN's
``include_zero``); ``top_k`` still counts ``ratio`` of all groups. ``mode``: ``largest`` or
``smallest`` first; ``std``/``std_rev`` are StarPO-S's names for largest/smallest reward std.

The kept groups' advantage multipliers (:attr:`GroupSelection.weights`): ``loss_scaling``
``linear`` or ``sqrt`` of the kept share of groups (RAGEN's ``filter_loss_scaling``: a small kept
share makes a smaller step), times, with ``soft_reweight``, each group's reward std over the
largest kept one (RAGEN-2's soft reweighting instead of a hard cut, applied to GRPO only).

Where this differs from RAGEN's code, and why:

- ``reward_std`` is RAGEN's ``reward_variance`` (its code takes ``torch.std``); our
  ``reward_variance`` is the square of it, which matters for ``top_p`` linear and ``min_p``.
- ``entropy`` is each turn's mean negative log-prob of its sampled tokens (the engine's, so no
  extra forward pass; an unbiased estimate of the sampling distribution's entropy), averaged
  over a member's turns; RAGEN recomputes the full-vocabulary entropy with the actor.
- Ties are broken by ascending group id (RAGEN's ``topk`` breaks them arbitrarily), so a choice
  is reproducible.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from ragen_mega.algo.advantages import group_stats

FILTER_MODES = ("std", "std_rev", "largest", "smallest")
TOP_P_MODES = ("linear", "softmax")
LOSS_SCALINGS = ("none", "linear", "sqrt")
#: every setting :func:`select_groups` reads, the ``filter`` section's field names
FILTER_SETTINGS = ("strategy", "ratio", "top_p", "top_p_mode", "min_p", "mode", "metric",
                   "include_zero", "selection_eps", "loss_scaling", "soft_reweight")

# ratio * n_groups is floored, but 0.29 * 100 is 28.999999999999996 in floating point
_FLOOR_TOLERANCE = 1e-9
# a group whose score is within this of 0 is a "zero" group (RAGEN's include_zero test)
_ZERO = 1e-10
# soft reweighting's denominator guard (RAGEN-2's)
_SOFT_EPS = 1e-6


class MemberValues(NamedTuple):
    """One entry per group member (an episode, or an env stream's window): what a metric reads."""

    reward: torch.Tensor  #: [m] the member's total reward
    group_ids: torch.Tensor  #: [m]
    entropy: torch.Tensor | None = None  #: [m] mean over its turns of a turn's mean token NLL
    length: torch.Tensor | None = None  #: [m] response tokens over its turns


class GroupSelection(NamedTuple):
    """What :func:`select_groups` kept."""

    keep_mask: torch.Tensor  #: [m] bool, True for members of kept groups
    kept_group_ids: torch.Tensor  #: kept group ids, ascending (may be empty: see top_p, min_p)
    metrics: dict[str, torch.Tensor]  #: detached scalars, see :func:`select_groups`
    weights: torch.Tensor  #: [len(kept_group_ids)] the kept groups' advantage multipliers
    group_ids: torch.Tensor  #: [n_groups] every group id, ascending
    scores: torch.Tensor  #: [n_groups] each group's score by ``metric`` (float64)


GroupMetric = Callable[[MemberValues], torch.Tensor]
GROUP_METRICS: dict[str, GroupMetric] = {}


def group_metric(name: str):
    """Register the decorated ``MemberValues -> [n_groups] score`` (groups in ascending id
    order, as :func:`~ragen_mega.algo.advantages.group_stats` gives them) as ``name``."""
    def register(fn: GroupMetric) -> GroupMetric:
        GROUP_METRICS[name] = fn
        return fn
    return register


def _needs(members: MemberValues, field: str) -> torch.Tensor:
    value = getattr(members, field)
    if value is None:
        raise ValueError(f"filter metric reads each member's {field}, and none was given")
    return value


@group_metric("reward_std")
def _reward_std(members):
    """Unbiased std of the members' rewards (0 for one member): StarPO-S's score."""
    return group_stats(members.reward, members.group_ids).std


@group_metric("reward_variance")
def _reward_variance(members):
    return group_stats(members.reward, members.group_ids).std.square()


@group_metric("reward")
def _reward_mean(members):
    return group_stats(members.reward, members.group_ids).mean


@group_metric("entropy")
def _entropy_mean(members):
    return group_stats(_needs(members, "entropy"), members.group_ids).mean


@group_metric("length")
def _length_mean(members):
    return group_stats(_needs(members, "length"), members.group_ids).mean


Strategy = Callable[..., torch.Tensor]
STRATEGIES: dict[str, Strategy] = {}


def filter_strategy(name: str):
    """Register the decorated ``(scores, candidates, largest, n_groups, settings) -> kept`` as
    ``name``: ``scores`` [n_groups] float64, ``candidates`` the positions it may keep, in rank
    order (best first, ties by group id); it returns the kept positions."""
    def register(fn: Strategy) -> Strategy:
        STRATEGIES[name] = fn
        return fn
    return register


@filter_strategy("top_k")
def _top_k(scores, candidates, largest, n_groups, settings):
    """``floor(ratio * n_groups)`` of all groups, at least one, at most the candidates."""
    k = max(1, int(settings["ratio"] * n_groups + _FLOOR_TOLERANCE))
    return candidates[:k]


@filter_strategy("top_p")
def _top_p(scores, candidates, largest, n_groups, settings):
    p = settings["top_p"]
    if p >= 1.0 or candidates.numel() == 0:
        return candidates
    ranked = scores[candidates]
    if settings["top_p_mode"] == "softmax":
        probs = torch.softmax(ranked if largest else -ranked, dim=0)
        mass = torch.cumsum(probs, dim=0)
        n = int(torch.searchsorted(mass, torch.tensor(p, dtype=mass.dtype))) + 1
        return candidates[:min(n, candidates.numel())]
    threshold = p * float(ranked.sum()) - settings["selection_eps"]
    total, n = 0.0, 0
    for value in ranked.tolist():  # RAGEN's walk: stop at the threshold or at a score <= 0
        if total >= threshold or value <= 0:
            break
        total += value
        n += 1
    return candidates[:n] if total >= threshold and n > 0 else candidates[:0]


@filter_strategy("min_p")
def _min_p(scores, candidates, largest, n_groups, settings):
    ranked = scores[candidates]
    if ranked.numel() == 0:
        return candidates
    p = settings["min_p"]
    if largest:
        keep = ranked >= p * ranked.max() - _ZERO
    else:
        keep = ranked <= ranked.min() / p + _ZERO
    return candidates[keep]


#: RAGEN-2's base config's ``rollout_filter_value``, which whichever strategy reads: the
#: default ``top_p`` and ``min_p``
RAGEN2_FILTER_VALUE = 0.9


def default_mode(metric: str) -> str:
    """Which end is kept when the user did not say: StarPO-S's ``std`` for ``reward_std``,
    ``largest`` for every other metric (a default never contradicts the metric chosen)."""
    return "std" if metric == "reward_std" else "largest"


def select_groups(rewards: torch.Tensor, group_ids: torch.Tensor, ratio: float = 0.25,
                  mode: str | None = None, *, strategy: str = "top_k",
                  metric: str = "reward_std",
                  top_p: float | None = None, top_p_mode: str = "linear",
                  min_p: float | None = None, include_zero: bool = True,
                  selection_eps: float = 0.01, loss_scaling: str = "none",
                  soft_reweight: bool = False, entropy: torch.Tensor | None = None,
                  length: torch.Tensor | None = None) -> GroupSelection:
    """Keep groups of members by ``metric`` and ``strategy`` (see the module docstring); the
    defaults are StarPO-S. Unset (None), ``mode`` follows the metric (:func:`default_mode`) and
    ``top_p`` / ``min_p`` are :data:`RAGEN2_FILTER_VALUE` under their strategy.

    ``rewards[i]`` is the total reward of member i (an episode), ``group_ids[i]`` its group;
    ``entropy`` and ``length`` (per member) are needed by those metrics only. Scores equal up
    to float noise ((0.1, 0.2) vs (0.2, 0.3)) tie, and ties go to the lower group id.

    For per-turn samples, pass one entry per member and mark the turns with
    ``torch.isin(turn_group_ids, selection.kept_group_ids)``.

    Metrics: ``in_group_std`` (mean reward std over all groups: the echo-trap signal, whatever
    the metric), ``chosen_in_group_std`` (over kept groups; 0 when none is kept),
    ``score``/``chosen_score`` (the metric's mean over all / kept groups), ``zero_groups``
    (groups scoring 0), ``kept_groups``, ``kept_ratio`` (kept / all groups).
    """
    mode = default_mode(metric) if mode is None else mode
    top_p = RAGEN2_FILTER_VALUE if top_p is None and strategy == "top_p" else top_p
    min_p = RAGEN2_FILTER_VALUE if min_p is None and strategy == "min_p" else min_p
    _check(rewards, group_ids, ratio, mode, strategy, metric, top_p, top_p_mode, min_p,
           selection_eps, loss_scaling)
    members = MemberValues(rewards, group_ids, entropy, length)
    stats = group_stats(rewards, group_ids)
    groups, stds = stats.ids, stats.std
    scores = GROUP_METRICS[metric](members).to(torch.float64)
    largest = mode in ("std", "largest")
    # rank order: best first, scores equal up to float noise tie, ties by ascending group id
    order = torch.sort(scores.round(decimals=9), descending=largest, stable=True).indices
    zero = scores.abs() <= _ZERO
    candidates = order if include_zero else order[~zero[order]]
    settings = {"ratio": ratio, "top_p": top_p, "top_p_mode": top_p_mode, "min_p": min_p,
                "selection_eps": selection_eps}
    chosen = torch.sort(STRATEGIES[strategy](scores, candidates, largest, groups.numel(),
                                             settings)).values
    kept_group_ids = groups[chosen]
    n_keep, n_groups = chosen.numel(), groups.numel()
    weights = torch.ones(n_keep, dtype=torch.float64)
    if soft_reweight and n_keep:
        weights = stds[chosen] / (stds[chosen].max() + _SOFT_EPS)
    share = n_keep / n_groups
    weights = weights * {"none": 1.0, "linear": share, "sqrt": math.sqrt(share)}[loss_scaling]
    empty = torch.tensor(0.0)
    metrics = {
        "in_group_std": stds.mean().float(),
        "chosen_in_group_std": stds[chosen].mean().float() if n_keep else empty,
        "score": scores.mean().float(),
        "chosen_score": scores[chosen].mean().float() if n_keep else empty,
        "zero_groups": zero.sum().float(),
        "kept_groups": torch.tensor(float(n_keep)),
        "kept_ratio": torch.tensor(share),
    }
    return GroupSelection(torch.isin(group_ids, kept_group_ids), kept_group_ids, metrics,
                          weights, groups, scores)


def _check(rewards, group_ids, ratio, mode, strategy, metric, top_p, top_p_mode, min_p,
           selection_eps, loss_scaling) -> None:
    """ValueError naming the first bad argument of :func:`select_groups`."""
    def one_of(name, value, allowed):
        if value not in allowed:
            raise ValueError(f"unknown filter {name} {value!r}; allowed: {', '.join(allowed)}")
    one_of("mode", mode, FILTER_MODES)
    one_of("strategy", strategy, sorted(STRATEGIES))
    one_of("metric", metric, sorted(GROUP_METRICS))
    one_of("top_p_mode", top_p_mode, TOP_P_MODES)
    one_of("loss_scaling", loss_scaling, LOSS_SCALINGS)
    if not (0.0 < ratio <= 1.0):
        raise ValueError(f"filter ratio must be in (0, 1], got {ratio}")
    for name, value in (("top_p", top_p), ("min_p", min_p)):
        if strategy == name and (value is None or not 0.0 < value <= 1.0):
            raise ValueError(f"filter strategy {name} needs {name} in (0, 1], got {value}")
    if selection_eps < 0:
        raise ValueError(f"filter selection_eps must be >= 0, got {selection_eps}")
    if rewards.dim() != 1 or rewards.shape != group_ids.shape or rewards.numel() == 0:
        raise ValueError(f"expected equal non-empty [n] rewards and group_ids, got "
                         f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}")
