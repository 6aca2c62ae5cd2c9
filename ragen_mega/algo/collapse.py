"""RAGEN-2's collapse probes ("Reasoning Collapse in Agentic RL", arXiv 2604.06268; RAGEN's
``ragen/trainer/collapse_metrics.py``): does the reasoning still depend on its input?

Template collapse is reasoning that stays varied (entropy alone sees nothing) but no longer
depends on the prompt. The probe cross-scores: ``L[i, j] = log p(z_i | x_j)``, the log-prob of
sample i's reasoning ``z_i`` after prompt ``x_j``, for every sample i and every prompt j of the
batch; ``own[i]`` is the column of i's own prompt. From it, with ``N`` columns:

- ``matched_i = L[i, own[i]]``; ``marginal_i = logsumexp_j L[i, j] - log N`` (own column
  included): the reasoning's log-prob under the batch's prompts as a mixture;
- ``mi_estimate`` = mean(matched) - mean(marginal), a mutual-information estimate (upper bound
  ``log N``), on per-token means of ``L`` (nats a token; RAGEN's, a heuristic: the mixture is of
  mean log-probs) and ``mi_seq_estimate`` on sums (nats a sequence);
- ``mi_zscore`` = mean((matched - marginal) / (std(marginal) + 1e-3)) (population std);
- ``conditional_entropy_est`` = -mean(matched), ``reasoning_entropy_est`` = -mean(marginal)
  (their ``_seq_`` versions on sums): reasoning entropy = conditional entropy + MI;
- ``retrieval_accuracy``: the share of samples whose best-scoring prompt (per-token mean) is
  their own, a prompt equal to their own counting as their own; ``retrieval_chance_level`` the
  same for a guess (each sample's share of columns equal to its prompt, 1/N when all differ);
  ``retrieval_above_chance`` the difference.

Not built here (RAGEN's, left out): the EMA-normalised z-score and top-k retrieval.
"""
from __future__ import annotations

import math
from typing import Hashable, Sequence

import torch

STD_EPS = 1e-3


def collapse_metrics(lsum: torch.Tensor, lengths: torch.Tensor, own: torch.Tensor,
                     column_keys: Sequence[Hashable]) -> dict[str, float]:
    """The module's metrics from ``lsum`` [n, N] (summed log-probs of sample i's reasoning after
    prompt j), ``lengths`` [n] (reasoning tokens), ``own`` [n] (each sample's column) and
    ``column_keys`` (N prompts, equal keys for equal prompts)."""
    n, columns = lsum.shape
    if columns < 2 or n < 1 or lengths.shape != (n,) or own.shape != (n,) \
            or len(column_keys) != columns:
        raise ValueError(f"collapse_metrics: need lsum [n >= 1, N >= 2] with lengths, own [n] "
                         f"and N column keys; got {tuple(lsum.shape)}, {tuple(lengths.shape)}, "
                         f"{tuple(own.shape)}, {len(column_keys)}")
    if bool((lengths < 1).any()):
        raise ValueError("collapse_metrics: every reasoning needs at least one token")
    lsum = lsum.to(torch.float64)
    lmean = lsum / lengths.to(torch.float64)[:, None]
    rows = torch.arange(n)
    out: dict[str, float] = {"mi_upper_bound": math.log(columns)}
    for suffix, table in (("", lmean), ("_seq", lsum)):
        matched = table[rows, own]
        marginal = torch.logsumexp(table, dim=1) - math.log(columns)
        std = marginal.std(unbiased=False) if n > 1 else torch.tensor(0.0, dtype=torch.float64)
        out[f"mi{suffix}_estimate"] = float(matched.mean() - marginal.mean())
        out[f"mi_zscore{suffix}"] = float(((matched - marginal) / (std + STD_EPS)).mean())
        out[f"marginal_std{suffix}"] = float(std)
        out[f"conditional_entropy{suffix}_est"] = float(-matched.mean())
        out[f"reasoning_entropy{suffix}_est"] = float(-marginal.mean())
        if not suffix:
            out["matched_log_prob_mean"] = float(matched.mean())
            out["marginal_log_prob_mean"] = float(marginal.mean())
    same = torch.tensor([[column_keys[a] == column_keys[b] for b in range(columns)]
                         for a in range(columns)])
    guess = lmean.argmax(dim=1)
    accuracy = float(same[own, guess].to(torch.float64).mean())
    chance = float(same[own].to(torch.float64).sum(dim=1).mean() / columns)
    out.update(retrieval_accuracy=accuracy, retrieval_chance_level=chance,
               retrieval_above_chance=accuracy - chance)
    return out
