"""Summaries of a step's episodes: the ``rollout/...`` and ``val/...`` scalars of the loop.

Each summary is over all episodes (``prefix/...``) and per env tag (``prefix/<tag>/...``): RAGEN
logs per tag, and a mixed run's total hides which env learns.
"""
from __future__ import annotations

import torch

from ragen_mega.algo.advantages import group_stats
from ragen_mega.rollout.episode import Episode
from ragen_mega.rollout.sample import Sample


def summarize(episodes: list[Episode], prefix: str) -> dict[str, float]:
    """Means of the per-episode metrics, reward mean/std, response length, pass@k over groups
    of k episodes, ``mixed_groups`` (share of groups with both a won and a lost episode) and
    ``wins_after_turn_1`` (share of won episodes that won after turn 1; absent when none won),
    under ``prefix/`` and per env tag under ``prefix/<tag>/``. Per tag also the mean in-group
    reward std, that env's echo-trap signal (run-wide: the filter's ``filter/in_group_std``)."""
    out = _episode_stats(episodes, prefix)
    by_tag: dict[str, list[Episode]] = {}
    for e in episodes:
        by_tag.setdefault(e.samples[0].env_tag, []).append(e)
    for tag, tagged in by_tag.items():
        out.update(_episode_stats(tagged, f"{prefix}/{tag}"))
        group_ids = torch.tensor([e.samples[0].group_id for e in tagged])
        if len(tagged) > len(set(group_ids.tolist())):  # groups of more than one episode
            rewards = torch.tensor([e.metrics["reward"] for e in tagged])
            out[f"{prefix}/{tag}/group_reward_std_before_filter"] = float(
                group_stats(rewards, group_ids).std.mean())
    return out


def summarize_window(samples: list[Sample], finished: list[Episode], prefix: str, *,
                     trained_version: int) -> dict[str, float]:
    """A streamed step (``rollout.mode: turns``): :func:`summarize` of the episodes that finished
    in it (if any), without its group scalars (``pass@k``, ``group_reward_std_before_filter``):
    a group's episodes that end in one step may be different seeds' (streams drift apart), and
    ``filter/in_group_std`` is the streams' spread. Over all and per env tag also ``samples``
    (turn samples played), ``episodes_finished``, ``episode_length`` (mean turns of the finished
    episodes, if any), ``weight_staleness`` (mean versions between sampling and
    ``trained_version``) and ``response_length`` over every sample of the window."""
    out = {k: v for k, v in (summarize(finished, prefix) if finished else {}).items()
           if "/pass@" not in k and not k.endswith("/group_reward_std_before_filter")}
    parts = [(prefix, samples, finished)]
    tags = sorted({s.env_tag for s in samples})
    parts += [(f"{prefix}/{tag}", [s for s in samples if s.env_tag == tag],
               [e for e in finished if e.samples[0].env_tag == tag]) for tag in tags]
    for name, tagged, ended in parts:
        out[f"{name}/samples"] = float(len(tagged))
        out[f"{name}/episodes_finished"] = float(len(ended))
        if ended:
            out[f"{name}/episode_length"] = sum(e.metrics["num_turns"] for e in ended) / len(ended)
        out[f"{name}/weight_staleness"] = weight_staleness(tagged, trained_version)
        out[f"{name}/response_length"] = sum(len(s.response_ids) for s in tagged) / len(tagged)
    return out


def weight_staleness(samples: list[Sample], trained_version: int) -> float:
    """Mean weight versions between each sample's sampling and ``trained_version``."""
    return sum(trained_version - s.weight_version for s in samples) / len(samples)


def _episode_stats(episodes: list[Episode], prefix: str) -> dict[str, float]:
    out: dict[str, float] = {}
    # every episode has the same keys, but ``progression`` only where its env reported one: an
    # episode without counts as no progress
    for key in dict.fromkeys(k for e in episodes for k in e.metrics):
        if key != "reward":  # published as reward_mean, next to its std
            out[f"{prefix}/{key}"] = sum(e.metrics.get(key, 0.0) for e in episodes) / len(episodes)
    rewards = torch.tensor([e.metrics["reward"] for e in episodes])
    out[f"{prefix}/reward_mean"] = float(rewards.mean())
    out[f"{prefix}/reward_std"] = float(rewards.std()) if len(episodes) > 1 else 0.0
    lengths = [len(s.response_ids) for e in episodes for s in e.samples]
    out[f"{prefix}/response_length"] = sum(lengths) / len(lengths)
    groups: dict[int, list[float]] = {}
    for e in episodes:
        groups.setdefault(e.samples[0].group_id, []).append(e.metrics["success"])
    k = min(len(g) for g in groups.values())
    if k > 1:  # pass@k: a group counts if any of its k episodes succeeded
        out[f"{prefix}/pass@{k}"] = sum(max(g) for g in groups.values()) / len(groups)
    if max(len(g) for g in groups.values()) > 1:  # a group-relative estimator's signal
        out[f"{prefix}/mixed_groups"] = sum(max(g) > min(g) for g in groups.values()) / len(groups)
    won = [e for e in episodes if e.metrics["success"]]
    if won:  # a win after turn 1 used what the env showed after the first answer
        out[f"{prefix}/wins_after_turn_1"] = sum(e.metrics["num_turns"] > 1 for e in won) / len(won)
    return out
