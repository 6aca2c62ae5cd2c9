"""One training row per episode when its turns share one growing prefix (RAGEN's whole-chat StarPO).

With unbounded memory (``agent.memory_turns: null``, past responses spliced in as sampled) turn
k+1's prompt ids begin with turn k's prompt + response ids, so the episode's last prompt +
response holds every turn's tokens, each at the SAME column as in its own row. Training that one
row instead of n per-turn rows feeds the shared prefix once, and the loss sees the same thing:
causal attention gives each token the same context (same log-probs and critic values), response
tokens keep their engine log-probs, observations and templates stay out of the loss, and the
token-mean sums the same tokens over the same count.

The estimators keep reading the per-turn batch; this module only moves per-token tensors between
the two layouts (:meth:`TrainLayout.to_train`, :meth:`TrainLayout.to_per_turn`), columns
unchanged. The prefix property is checked per episode; an episode without it (a memory window,
answers re-rendered as text, a prompt that sheds old turns, an empty response) keeps its
per-turn rows and is counted.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ragen_mega.algo.losses import TOKEN_WEIGHTED
from ragen_mega.rollout.sample import Sample


def grows_by_prefix(turns: Sequence[Sample]) -> bool:
    """True when every turn's prompt begins with the previous turn's prompt + response ids (turns
    numbered consecutively, every response non-empty): then the last prompt + response is the
    whole episode with each turn's tokens at their own columns."""
    for prev, cur in zip(turns, turns[1:]):
        seen = len(prev.prompt_ids) + len(prev.response_ids)
        if (cur.turn != prev.turn + 1 or not prev.response_ids
                or cur.prompt_ids[:seen] != prev.prompt_ids + prev.response_ids):
            return False
    return bool(turns[-1].response_ids)


@dataclasses.dataclass
class TrainLayout:
    """The training batch and the map from the per-turn batch's rows to its rows."""
    batch: dict[str, torch.Tensor]   # input_ids, attention_mask, loss_mask, rollout_logprobs,
                                     # episode_id: one row per packed episode, else per turn
    rows: torch.Tensor               # [n_turn_rows] the training row of each per-turn row
    turn_loss_mask: torch.Tensor     # the per-turn batch's loss_mask [n_turn_rows, S]
    turn_lengths: torch.Tensor       # the per-turn rows' token counts
    metrics: dict[str, float]

    def to_train(self, per_turn: torch.Tensor) -> torch.Tensor:
        """A per-token tensor of the per-turn layout (advantages, returns, loss mask, log-probs)
        at the training layout's loss tokens; 0 elsewhere, as the estimators leave it."""
        r, c = torch.nonzero(self.turn_loss_mask, as_tuple=True)
        out = per_turn.new_zeros(self.batch["input_ids"].shape)
        out[self.rows[r], c] = per_turn[r, c]
        return out

    def to_per_turn(self, train: torch.Tensor) -> torch.Tensor:
        """A per-token tensor of the training layout (critic values) back in the per-turn layout:
        each turn row's columns up to its length (column = length is the state after the whole
        row, which a value reads), 0 past it, as the trainer computes it on the per-turn rows."""
        n, width = self.turn_loss_mask.shape
        out = train.new_zeros(n, width)
        w = min(width, train.shape[1])
        out[:, :w] = train[self.rows, :w]
        keep = torch.arange(width)[None, :] <= self.turn_lengths[:, None]
        return out * keep.to(out.device)


def layouts_agree(mode: str, loss_agg_modes: Sequence[str]) -> bool:
    """Packing is on when ``mode`` (``trainer.pack_trajectories``) is ``auto`` and every trained
    model's loss sums its loss mask (``token-mean``, ``episode-mean-token-mean``): the
    ``seq-mean-*`` modes weigh each SEQUENCE alike, so packing would change the objective."""
    return mode == "auto" and all(m in TOKEN_WEIGHTED for m in loss_agg_modes)


def pack_trajectories(samples: Sequence[Sample], per_turn: dict[str, torch.Tensor], *,
                      enabled: bool) -> TrainLayout:
    """The training layout of ``per_turn`` (``build_batch(samples)``, row i = ``samples[i]``).

    ``enabled``: every episode of two or more turns whose prompts grow by prefix
    (:func:`grows_by_prefix`) becomes one row, its last turn's; the others keep their rows and
    count in ``train/pack_fallbacks``. Episodes come in order of first appearance, so PPO
    mini-batches (counted in episodes) hold the same episodes in both layouts. Disabled: the
    per-turn rows as they are.
    """
    if len(samples) != per_turn["input_ids"].shape[0]:
        raise ValueError(f"pack_trajectories: {len(samples)} samples but the per-turn batch has "
                         f"{per_turn['input_ids'].shape[0]} rows")
    episodes: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        episodes.setdefault(s.episode_id, []).append(i)
    packed, fallbacks = {}, 0
    for episode, rows in episodes.items():
        if not enabled or len(rows) < 2:
            continue
        rows = sorted(rows, key=lambda i: samples[i].turn)
        if grows_by_prefix([samples[i] for i in rows]):
            packed[episode] = rows[-1]
        else:
            fallbacks += 1
    source, row_of = [], torch.empty(len(samples), dtype=torch.long)
    for episode, rows in episodes.items():
        if episode in packed:
            row_of[rows] = len(source)
            source.append(packed[episode])
            continue
        for i in rows:
            row_of[i] = len(source)
            source.append(i)
    source = torch.tensor(source)
    lengths = per_turn["attention_mask"].sum(dim=1)
    width = int(lengths[source].max())
    batch = {"input_ids": per_turn["input_ids"][source, :width],
             "attention_mask": per_turn["attention_mask"][source, :width],
             "episode_id": per_turn["episode_id"][source]}
    layout = TrainLayout(batch, row_of, per_turn["loss_mask"], lengths,
                         {"train/packed_episodes": float(len(packed)),
                          "train/pack_fallbacks": float(fallbacks)})
    batch["loss_mask"] = layout.to_train(per_turn["loss_mask"])
    batch["rollout_logprobs"] = layout.to_train(per_turn["rollout_logprobs"])
    if "routed_experts" in per_turn:  # a packed row is its last turn's, whose request read it all
        batch["routed_experts"] = per_turn["routed_experts"][source, :width]
    return layout
