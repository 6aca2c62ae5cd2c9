"""GiGPO: critic-free step-level credit (Feng et al. 2025, "Group-in-Group Policy Optimization
for LLM Agent Training", arXiv 2505.10978; verl-agent's ``gigpo/core_gigpo.py``).

GRPO gives every turn of an episode the same advantage, so a turn that walked into a hole and one
that walked round it share one number. GiGPO adds a finer grouping without a critic: a group's
episodes start from the same state, so they keep meeting the same *anchor states*, and the turns
taken from one anchor state form a *step group* whose members can be compared directly. Each
turn's advantage is::

    A = A_episode + step_weight * A_step

- ``A_episode`` (Eq. 3): the episode's total reward against its group's, as :func:`grpo`;
- ``A_step`` (Eq. 5-7): the turn's discounted return from its state on, ``R_t = r_t + gamma *
  R_{t+1}`` over its episode's turns, against the returns of the other turns of its step group.

Both levels subtract the group mean and, with ``norm_by_std``, divide by its std (verl-agent's
``mean_std_norm``; ``False`` is its ``mean_norm``). A step group of one turn gets ``A_step = 0``
(verl-agent: the same 0).

Where this differs from verl-agent: its episode-level statistics are by default over the group's
*turns* (``compute_mean_std_cross_steps``: a long episode counts once per turn), here over its
episodes, as the paper's Eq. 3 and :func:`grpo`; a group of one episode gets 0 here, its raw
score there (see :func:`grpo`).
"""
from __future__ import annotations

from difflib import SequenceMatcher
from typing import Sequence

import torch

from ragen_mega.algo.advantages import (_episode_layout, _masked_gae_scan, _check_samples,
                                        episode_scores, grpo, normalize_scores)


def anchor_groups(state_keys: Sequence[str], group_ids: Sequence[int],
                  similarity: float | None = None) -> torch.Tensor:
    """The step group of each turn ``[n]`` (int64 ids, numbered in order of first appearance):
    turns of one episode group (``group_ids``: same seed) whose anchor states match.

    ``state_keys[i]`` is the key of the state turn i acts in (``TextEnv.state_key``; default: the
    observation text). Matching is exact, or with ``similarity`` in (0, 1) approximate, as
    verl-agent's ``enable_similarity``: a turn joins the first-created step group whose first key
    has a :class:`difflib.SequenceMatcher` ratio >= ``similarity`` with its own, else starts one.
    Turns of different episode groups never share a step group.
    """
    if len(state_keys) != len(group_ids):
        raise ValueError(f"anchor_groups: {len(state_keys)} state keys but {len(group_ids)} "
                         f"group ids")
    if similarity is not None and not 0.0 < similarity < 1.0:
        raise ValueError(f"anchor_groups: similarity must be in (0, 1) (None: exact match), "
                         f"got {similarity}")
    exact: dict[tuple[int, str], int] = {}                 # (episode group, key) -> step group
    similar: dict[int, list[tuple[str, int]]] = {}         # episode group -> [(first key, id)]
    out: list[int] = []
    n_groups = 0
    for key, group in zip(state_keys, group_ids):
        group = int(group)
        if similarity is None:
            found = exact.get((group, key))
        else:
            found = next((i for first, i in similar.get(group, ())
                          if SequenceMatcher(None, key, first).ratio() >= similarity), None)
        if found is None:
            found, n_groups = n_groups, n_groups + 1
            exact[(group, key)] = found
            similar.setdefault(group, []).append((key, found))
        out.append(found)
    return torch.tensor(out, dtype=torch.int64)


@torch.no_grad()
def step_returns(rewards: torch.Tensor, episode_ids: torch.Tensor, turn_indices: torch.Tensor,
                 gamma: float = 1.0) -> torch.Tensor:
    """Each turn's discounted return over its episode's turns in the batch (GiGPO's Eq. 5):
    ``R_t = r_t + gamma * R_{t+1}``, 0 after the episode's last turn here. Turns may come in any
    order; an episode's turns must be unique and consecutive (a streamed window of an episode is
    fine: its return then ends at the window)."""
    _check_samples(rewards=rewards, episode_ids=episode_ids, turn_indices=turn_indices)
    row, col, last_col = _episode_layout(episode_ids, turn_indices)
    n_rows, n_cols = last_col.shape[0], int(last_col.max()) + 1
    grid = torch.zeros(n_rows, n_cols, dtype=torch.float64)
    grid_rewards = grid.index_put((row, col), rewards.to(torch.float64))
    grid_mask = grid.bool().index_put((row, col), torch.ones_like(row, dtype=torch.bool))
    # GAE with every value 0 and lambda 1 is the discounted return
    returns, _ = _masked_gae_scan(grid_rewards, grid, grid_mask, gamma, 1.0,
                                  torch.zeros(n_rows, dtype=torch.float64))
    return returns[row, col].to(rewards.dtype)


@torch.no_grad()
def gigpo(rewards: torch.Tensor, episode_ids: torch.Tensor, group_ids: torch.Tensor,
          turn_indices: torch.Tensor, step_groups: torch.Tensor, *, step_weight: float = 1.0,
          gamma: float = 1.0, norm_by_std: bool = True, reward_norm: str = "identity",
          members: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GiGPO's advantage of each turn ``[n]``; returns ``(advantages, episode term, step term)``.

    ``rewards[i]`` is turn i's reward, ``episode_ids``/``group_ids``/``turn_indices`` place it,
    ``step_groups`` is :func:`anchor_groups`' output. The episode term scores each group member
    by its turns' summed reward, normalised by ``reward_norm`` (:func:`normalize_scores`), then
    :func:`grpo`; a member is its episode, or ``members[i]`` when given (streamed steps: the env
    stream, whose window sums compare across a group). Step returns discount by ``gamma``.
    """
    _check_samples(rewards=rewards, episode_ids=episode_ids, group_ids=group_ids,
                   turn_indices=turn_indices, step_groups=step_groups)
    members = episode_ids if members is None else members
    member_ids, member_groups, scores = episode_scores(members, group_ids, rewards)
    scores = normalize_scores(scores, member_groups, reward_norm)
    inverse = torch.searchsorted(member_ids, members)
    episode_term = grpo(scores, member_groups, norm_by_std=norm_by_std)[inverse]
    returns = step_returns(rewards.float(), episode_ids, turn_indices, gamma)
    step_term = grpo(returns, step_groups, norm_by_std=norm_by_std)
    return episode_term + step_weight * step_term, episode_term, step_term


def step_group_metrics(step_groups: torch.Tensor, step_term: torch.Tensor) -> dict[str, float]:
    """A step's GiGPO scalars: how often anchor states repeat, and how much the step term says.

    ``gigpo/shared_state_rate``: the share of turns whose step group holds another turn (only
    those get a step term); ``gigpo/step_group_size``: the mean size of the step groups;
    ``gigpo/step_adv_abs``: the mean absolute step term over all turns."""
    _, inverse, counts = torch.unique(step_groups, return_inverse=True, return_counts=True)
    return {"gigpo/shared_state_rate": float((counts[inverse] > 1).float().mean()),
            "gigpo/step_group_size": float(counts.float().mean()),
            "gigpo/step_adv_abs": float(step_term.abs().float().mean())}
