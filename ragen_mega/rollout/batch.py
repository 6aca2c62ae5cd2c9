"""From played episodes to a training batch: StarPO-S filter, collate, the cut bootstrap's input.

Plain functions over :class:`Sample` records and tensors (the estimators are
``algo/estimators.py``):

1. :func:`filter_groups` - StarPO-S (and RAGEN-2's generalisation, ``algo/filter.py``): keep
   the groups whose episode rewards vary most.
2. :func:`build_batch` - :func:`collate` (from :mod:`.sample`) plus the per-turn fields the
   estimators need.
3. :func:`cut_value_batch` - the critic's input for the states after the cut of a streamed step.

An episode cut off by ``max_turns`` is treated as terminal, as RAGEN does; one cut by the end of
a streamed step's window (``rollout.mode: turns``) bootstraps from the critic's value of its
next state.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ragen_mega.algo.advantages import episode_scores
from ragen_mega.algo.filter import select_groups
from ragen_mega.algo.gigpo import anchor_groups
from ragen_mega.rollout.sample import Sample, collate


class Filtered(NamedTuple):
    """What :func:`filter_groups` kept, and why."""
    samples: list[Sample]               #: the kept groups' samples, in the played order
    metrics: dict[str, float]           #: ``filter/*``
    weights: torch.Tensor               #: [len(samples)] each kept sample's advantage weight
    scores: dict[int, float]            #: every group's score (the filter's metric), by group id


def filter_groups(samples: Sequence[Sample], by_stream: bool = False, **settings) -> Filtered:
    """The rollout filter (``settings``: :func:`select_groups`'s, the ``filter`` section): the
    kept groups' samples, the ``filter/*`` metrics, each kept sample's advantage weight (1 unless
    ``filter.loss_scaling`` or ``filter.soft_reweight``) and every group's score (for the
    trajectory files). All groups are ranked together, as in RAGEN; a mixed-env step also
    reports ``filter/<tag>/kept_groups``, since one env can crowd out another. The kept list may
    be empty (``top_p``/``min_p`` find no group worth training).

    A group member is an episode, scored by its total reward, its turns' mean token NLL
    (``entropy``) and its response tokens (``length``). ``by_stream`` (``rollout.mode: turns``)
    takes each env stream's turns in this step's window instead: a group's streams played the
    same seeds for the same number of turns, so their window sums are comparable where their
    episodes are not (docs/design.md, "Long horizons")."""
    member_ids = torch.tensor([s.stream if by_stream else s.episode_id for s in samples])
    members, group_ids, scores = episode_scores(member_ids,
                                                torch.tensor([s.group_id for s in samples]),
                                                torch.tensor([s.reward for s in samples]))
    member_of = torch.searchsorted(members, member_ids)

    def per_member(values):  # summed over each member's turns, members as episode_scores's
        return torch.zeros(members.numel(), dtype=torch.float64).index_add_(
            0, member_of, torch.tensor(values, dtype=torch.float64))

    turn_nll = [-sum(s.rollout_logprobs) / max(len(s.rollout_logprobs), 1) for s in samples]
    selection = select_groups(
        scores, group_ids, **settings,
        entropy=per_member(turn_nll) / per_member([1.0] * len(samples)),
        length=per_member([float(len(s.response_ids)) for s in samples]))
    weight_of = dict(zip(selection.kept_group_ids.tolist(), selection.weights.tolist()))
    metrics = {f"filter/{k}": float(v) for k, v in selection.metrics.items()}
    tags = {s.env_tag for s in samples}
    if len(tags) > 1:
        for tag in sorted(tags):
            metrics[f"filter/{tag}/kept_groups"] = float(
                len({s.group_id for s in samples if s.env_tag == tag and s.group_id in weight_of}))
    kept = [s for s in samples if s.group_id in weight_of]
    return Filtered(kept, metrics,
                    torch.tensor([weight_of[s.group_id] for s in kept], dtype=torch.float32),
                    dict(zip(selection.group_ids.tolist(), selection.scores.tolist())))


def build_batch(samples: Sequence[Sample], pad_id: int, state_similarity: float | None = None
                ) -> dict[str, torch.Tensor]:
    """:func:`collate` plus per-sample ``reward``, ``episode_id``, ``group_id``, ``turn``,
    ``last`` (the episode's final turn, treated as terminal), ``cut`` (the step's last turn of
    an episode that goes on, ``rollout.mode: turns``), ``member`` (what a group member's score
    sums over: its episode, or in streamed steps its env stream, as :func:`filter_groups`
    scores it) and ``state_group`` (GiGPO's step groups: :func:`anchor_groups` of the samples'
    state keys, matched exactly or, with ``state_similarity``, approximately)."""
    batch = collate(samples, pad_id)
    batch["reward"] = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    for key in ("episode_id", "group_id", "turn", "last", "cut"):
        batch[key] = torch.tensor([getattr(s, key) for s in samples])
    batch["member"] = torch.tensor([s.episode_id if s.stream is None else s.stream
                                    for s in samples])
    batch["state_group"] = anchor_groups([s.state_key for s in samples],
                                         [s.group_id for s in samples], state_similarity)
    return batch


def cut_value_batch(samples: Sequence[Sample], next_prompts: dict[int, list[int]], pad_id: int,
                    rows_multiple_of: int = 1
                    ) -> tuple[dict[str, torch.Tensor], list[int], torch.Tensor] | None:
    """The critic's input for the cut bootstrap (``rollout.mode: turns``): one row per cut
    sample holding the prompt its episode's next turn will get (valued, never trained on),
    padded with copies of the first row to a multiple of ``rows_multiple_of`` (the critic
    shards rows over its data-parallel replicas). Returns ``(batch, rows, columns)``: the cut
    samples' indices and, per row, the column that holds V(prompt) (one token after the prompt,
    the trainer's layout); None when no sample is cut."""
    rows = [i for i, s in enumerate(samples) if s.cut]
    if not rows:
        return None
    prompts = [next_prompts[samples[i].episode_id] for i in rows]
    prompts += [prompts[0]] * (-len(prompts) % rows_multiple_of)
    seq = max(map(len, prompts)) + 1
    ids = torch.full((len(prompts), seq), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
        attention[i, :len(p) + 1] = 1
    columns = torch.tensor([len(p) for p in prompts[:len(rows)]])
    return {"input_ids": ids, "attention_mask": attention}, rows, columns
