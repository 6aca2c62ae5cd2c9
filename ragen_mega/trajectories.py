"""Every step's episodes on disk (``trainer.save_trajectories``): what the agent saw and wrote,
turn by turn, with the credit it got.

The run directory's ``trajectories/`` holds ``step_N.jsonl.gz`` (step N's training rollout, every
group the filter saw) and ``eval_step_N.jsonl.gz`` (the held-out evaluation after step N; step 0:
the start weights). One JSON record per line, one per episode (in ``rollout.mode: turns``, per
stream window of an episode)::

    schema          SCHEMA, the version of this layout
    kind            "train" | "eval"
    step            the trainer step (eval: the step whose weights were evaluated)
    tag, seed       the env's tag (its name unless env.mix names it) and the seed it was reset with
    group, episode  the group (episodes sharing a seed) and the episode's id in the step
    weight_version  the trainer step whose weights played it (one step behind with
                    trainer.async_mode or in streamed windows)
    return          the sum of its turns' rewards (format penalties included)
    success         whether any env step reported success
    kept            whether the filter kept its group (null: eval, nothing is filtered)
    group_score     the filter's score of its group (its metric: reward std by default; null: eval)
    window          streamed steps only: {"first_turn", "cut": the episode goes on after this
                    window, "bootstrap": the critic's value it bootstraps from when cut, or null}
    turns           one per turn:
        turn             1-based, in the episode
        observation      the env's observation text it acted on ("" for a user agent's call)
        prompt_tokens    the prompt's length in tokens (history and template included)
        response         the response exactly as sampled (special tokens kept)
        response_tokens  its length in tokens
        finish_reason    the engine's ("stop": a stop string, "length": max_new_tokens)
        format_ok        whether it parsed as the agent's answer format
        example_copy     whether its actions are the prompt's example answer (the echo trap's
                         favourite; null for a user agent's call)
        actions          the env steps it made: [{"action", "reward", "done", "info"}]
        reward, done     the turn's reward (env rewards + format penalty) and whether it ended
                         the episode
        advantage        the mean of its response tokens' advantages (null: filtered out, or eval)
        step_advantage   GiGPO's step term (null elsewhere)

``trainer.trajectory_samples: k`` keeps the first k groups of each step (by group id); unset,
every group. Files are written whole or not at all (a temporary file renamed into place): a
killed run leaves no half-written step, and a resumed step overwrites its file.
"""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Sequence

import torch

from ragen_mega.rollout.sample import Sample

#: the record layout's version: bump it when a field changes meaning or goes away
SCHEMA = 1
DIRNAME = "trajectories"


def step_file(run_dir: str | Path, step: int, kind: str = "train") -> Path:
    """Where step ``step``'s records of ``kind`` (train or eval) go."""
    prefix = {"train": "step", "eval": "eval_step"}[kind]
    return Path(run_dir) / DIRNAME / f"{prefix}_{step}.jsonl.gz"


def episode_records(samples: Sequence[Sample], tokenizer, *, kind: str, step: int,
                    scores: dict[int, float] | None = None,
                    kept: Iterable[Sample] = (),
                    advantages: torch.Tensor | None = None,
                    step_advantages: torch.Tensor | None = None,
                    bootstrap: torch.Tensor | None = None,
                    groups: int | None = None) -> list[dict[str, Any]]:
    """One record per episode of ``samples`` (a step's played turns, in order), as the module
    docstring lays out. ``kept`` are the samples the filter kept, in the order of the rows of
    ``advantages`` [K, S] (token advantages) / ``step_advantages`` [K] / ``bootstrap`` [K] (the
    cut turns' bootstrap values); ``scores`` every group's filter score. ``groups``: keep only
    the first that many groups by id."""
    kept = list(kept)
    row_of = {id(s): i for i, s in enumerate(kept)}
    if groups is not None:
        first = set(sorted({s.group_id for s in samples})[:groups])
        samples = [s for s in samples if s.group_id in first]
    episodes: dict[tuple[int, int | None], list[Sample]] = {}
    for s in samples:
        episodes.setdefault((s.episode_id, s.stream), []).append(s)
    kept_groups = {s.group_id for s in kept}
    records = []
    for turns in episodes.values():
        head = turns[0]
        record = {
            "schema": SCHEMA, "kind": kind, "step": step, "tag": head.env_tag, "seed": head.seed,
            "group": head.group_id, "episode": head.episode_id,
            "weight_version": head.weight_version,
            "return": sum(s.reward for s in turns),
            "success": any(a.get("info", {}).get("success") for s in turns
                           for a in s.info.get("steps", ())),
            "kept": None if scores is None else head.group_id in kept_groups,
            "group_score": None if scores is None else scores.get(head.group_id),
            "turns": [_turn(s, tokenizer, row_of.get(id(s)), advantages, step_advantages)
                      for s in turns]}
        if head.stream is not None:
            last = turns[-1]
            row = row_of.get(id(last))
            record["window"] = {
                "first_turn": head.turn, "cut": last.cut,
                "bootstrap": (float(bootstrap[row]) if last.cut and bootstrap is not None
                              and row is not None else None)}
        records.append(record)
    return records


def _turn(s: Sample, tokenizer, row: int | None, advantages: torch.Tensor | None,
          step_advantages: torch.Tensor | None) -> dict[str, Any]:
    advantage = step_advantage = None
    if row is not None and advantages is not None:
        start, n = len(s.prompt_ids), len(s.response_ids)
        advantage = float(advantages[row, start:start + n].mean()) if n else 0.0
    if row is not None and step_advantages is not None:
        step_advantage = float(step_advantages[row])
    return {"turn": s.turn, "observation": s.observation, "prompt_tokens": len(s.prompt_ids),
            "response": tokenizer.decode(s.response_ids, skip_special_tokens=False),
            "response_tokens": len(s.response_ids),
            "finish_reason": s.info.get("finish_reason"), "format_ok": s.info.get("format_ok"),
            "example_copy": s.info.get("example_copy"),
            "actions": s.info.get("steps", []), "reward": s.reward, "done": s.done,
            "advantage": advantage, "step_advantage": step_advantage}


def write_records(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """``records`` as gzipped JSON lines at ``path``, whole or not at all
    (:func:`write_whole`)."""
    def write(raw):
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
            for record in records:
                out.write((json.dumps(record) + "\n").encode())
    write_whole(path, write)


def write_whole(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """``write(file)`` into a temporary file beside ``path``, flushed to disk, then renamed over
    ``path``: a write that fails leaves ``path`` as it was, and no temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as raw:
            write(raw)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a trajectory file; ValueError naming the file and line for a record that
    is not JSON or was written by a newer schema than this reader's."""
    out = []
    with gzip.open(path, "rt") as f:
        for n, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {n} is not JSON ({e})") from None
            if not isinstance(record, dict) or record.get("schema", 0) > SCHEMA:
                raise ValueError(f"{path}: line {n} has schema {record.get('schema')!r} "
                                 f"(this version reads up to {SCHEMA}: upgrade ragen-mega)"
                                 if isinstance(record, dict) else
                                 f"{path}: line {n} is not a record (a JSON object)")
            out.append(record)
    return out
