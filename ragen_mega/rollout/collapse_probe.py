"""The collapse probes' input from a step's rollout (``trainer.collapse_every``; the metrics are
``algo/collapse.py``'s, under RAGEN-2's names ``collapse_first_turn_sample/...``).

As in RAGEN, on first turns: each episode's first-turn reasoning ``z_i`` (the response text
before ``</think>``) is scored after the first prompt ``x_j`` of every group of the step (one
column a group: its episodes share the seed, so the prompt). ``max_samples`` reasonings (without
replacement, seeded by the step) bound the cross batch at ``max_samples x groups`` rows. The
reasoning is the decoded text re-tokenized, as RAGEN does: ``</think>`` may share a token with
what precedes it, so the sampled ids cannot be cut at it. Log-probs come from the actor before
the step's update.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np
import torch

from ragen_mega.algo.collapse import collapse_metrics
from ragen_mega.rollout.sample import Sample, collate

_REASONING = re.compile(r"^(.*?)</think>", re.DOTALL)
FIRST_TURN = "collapse_first_turn_sample/"


def reasoning_text(sample: Sample, tokenizer) -> str:
    """The sample's reasoning (text before ``</think>``, stripped); '' if there is none."""
    found = _REASONING.match(tokenizer.decode(sample.response_ids, skip_special_tokens=True))
    return found.group(1).strip() if found else ""


def valid_thinking_rate(samples: Sequence[Sample], tokenizer) -> float:
    """RAGEN-2's ``valid_thinking_rate``: the share of turns with non-empty reasoning."""
    return sum(bool(reasoning_text(s, tokenizer)) for s in samples) / max(len(samples), 1)


@dataclasses.dataclass
class Probe:
    """The cross batch (rows ``i * N + j``: reasoning i after prompt j, padded rows after) and
    what reads its log-probs back."""
    batch: dict[str, torch.Tensor]
    n: int
    own: torch.Tensor          # [n] each reasoning's own column
    column_keys: list[tuple]   # N prompts, as token tuples
    lengths: torch.Tensor      # [n] reasoning tokens

    def metrics(self, logprobs: torch.Tensor) -> dict[str, float]:
        """:func:`~ragen_mega.algo.collapse.collapse_metrics` of the actor's log-probs of
        :attr:`batch` ([rows, S]), named ``collapse_first_turn_sample/<metric>``."""
        columns = len(self.column_keys)
        rows = self.n * columns
        mask = self.batch["loss_mask"][:rows]
        lsum = (logprobs[:rows].to(torch.float64) * mask).sum(dim=1).view(self.n, columns)
        return {FIRST_TURN + k: v
                for k, v in collapse_metrics(lsum, self.lengths, self.own,
                                             self.column_keys).items()}


def first_turn_probe(samples: Sequence[Sample], tokenizer, *, max_samples: int, seed: int,
                     rows_multiple_of: int = 1) -> Probe | None:
    """The probe of a step's first turns (module doc), or None when fewer than 2 groups or no
    reasoning is there to cross-score. Rows are padded with copies of the first to a multiple
    of ``rows_multiple_of`` (the actor shards rows over its data-parallel replicas)."""
    first = [s for s in samples if s.turn == 1]
    prompts: dict[int, list[int]] = {}
    for s in first:
        prompts.setdefault(s.group_id, s.prompt_ids)
    reasoned = [(s, text) for s in first if (text := reasoning_text(s, tokenizer))]
    if len(prompts) < 2 or not reasoned:
        return None
    rng = np.random.default_rng(seed)
    picked = sorted(rng.choice(len(reasoned), size=min(max_samples, len(reasoned)),
                               replace=False))
    groups = sorted(prompts)
    column_of = {g: j for j, g in enumerate(groups)}
    rows, own, lengths = [], [], []
    for i in picked:
        sample, text = reasoned[i]
        z = tokenizer.encode(text, add_special_tokens=False)
        own.append(column_of[sample.group_id])
        lengths.append(len(z))
        rows += [Sample(prompts[g], z, [0.0] * len(z), 0.0, len(rows) + j, g, 1, True, True,
                        sample.env_tag, sample.seed) for j, g in enumerate(groups)]
    rows += [rows[0]] * (-len(rows) % rows_multiple_of)
    return Probe(collate(rows, tokenizer.pad_token_id), len(picked), torch.tensor(own),
                 [tuple(prompts[g]) for g in groups], torch.tensor(lengths))
