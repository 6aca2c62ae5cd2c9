"""The trajectory files (``ragen_mega/trajectories.py``): hand-built steps through the real
filter and estimators, their records against hand-worked numbers; whole-or-nothing writes; a
newer schema refused by name. The files of a real run are checked in tests/test_learn.py."""
from __future__ import annotations

import gzip
import json
import math

import pytest
import torch

from ragen_mega import trajectories
from ragen_mega.algo.estimators import compute_advantages
from ragen_mega.config import AlgoConfig
from ragen_mega.rollout.batch import build_batch, filter_groups
from ragen_mega.rollout.sample import Sample


def turn(tokenizer, ep, group, t, reward, last, *, success=False, stream=None, cut=False):
    response = tokenizer.encode(" Up </answer>", add_special_tokens=False)
    steps = [{"action": "Up", "reward": reward, "done": last,
              "info": {"action_is_valid": True, "success": success}}]
    return Sample([1, 2, 3, 4], response, [-0.5] * len(response), reward, ep, group, t,
                  done=last, last=last, env_tag="lake", seed=100 + group,
                  info={"format_ok": True, "finish_reason": "stop", "steps": steps},
                  weight_version=6, stream=stream, cut=cut, state_key=f"s{ep}{t}",
                  observation=f"board {ep}.{t}")


def test_records_hold_each_turn_with_the_filter_verdict_and_its_credit(tokenizer):
    """Group 0 (episode 0: rewards 0 then 1, a success; episode 1: 0) varies and is kept by a
    half-ratio filter; group 1 (two episodes of reward 0) does not and is filtered out. GRPO,
    mean only: episode 0's two turns both get +0.5, episode 1's turn -0.5; group 1's turns
    no advantage. The group score is the in-group reward std (unbiased: 1/sqrt 2)."""
    samples = [turn(tokenizer, 0, 0, 1, 0.0, False), turn(tokenizer, 0, 0, 2, 1.0, True,
                                                          success=True),
               turn(tokenizer, 1, 0, 1, 0.0, True),
               turn(tokenizer, 2, 1, 1, 0.0, True), turn(tokenizer, 3, 1, 1, 0.0, True)]
    filtered = filter_groups(samples, ratio=0.5, mode="std")
    batch = compute_advantages(build_batch(filtered.samples, pad_id=0),
                               AlgoConfig(adv_estimator="grpo", grpo_norm_by_std=False))
    records = trajectories.episode_records(
        samples, tokenizer, kind="train", step=7, scores=filtered.scores,
        kept=filtered.samples, advantages=batch["advantages"])
    assert [r["episode"] for r in records] == [0, 1, 2, 3]
    first, second, dropped = records[0], records[1], records[2]
    assert first["schema"] == trajectories.SCHEMA and first["kind"] == "train"
    assert (first["step"], first["tag"], first["seed"], first["group"]) == (7, "lake", 100, 0)
    assert first["weight_version"] == 6 and "window" not in first
    assert first["return"] == 1.0 and first["success"] is True and second["success"] is False
    assert first["kept"] is True and dropped["kept"] is False
    assert first["group_score"] == pytest.approx(1 / math.sqrt(2))
    assert dropped["group_score"] == 0.0
    assert [t["advantage"] for t in first["turns"]] == pytest.approx([0.5, 0.5])
    assert second["turns"][0]["advantage"] == pytest.approx(-0.5)
    assert dropped["turns"][0]["advantage"] is None
    t1, t2 = first["turns"]
    assert (t1["turn"], t1["observation"], t1["prompt_tokens"]) == (1, "board 0.1", 4)
    assert t1["response"] == " Up </answer>" and t1["response_tokens"] == len(
        tokenizer.encode(" Up </answer>", add_special_tokens=False))
    assert t1["actions"][0]["action"] == "Up" and t1["actions"][0]["info"]["action_is_valid"]
    assert (t1["reward"], t1["done"], t2["reward"], t2["done"]) == (0.0, False, 1.0, True)
    assert t1["finish_reason"] == "stop" and t1["format_ok"] is True
    json.dumps(records)  # plain JSON throughout

    two = trajectories.episode_records(samples, tokenizer, kind="train", step=7,
                                       scores=filtered.scores, groups=1)
    assert {r["group"] for r in two} == {0}  # trainer.trajectory_samples: the first k groups


def test_streamed_windows_mark_the_cut_and_its_bootstrap(tokenizer):
    """A window of a stream's episode that goes on after the step: the record is the window,
    with its first turn, ``cut`` and the critic's value it bootstraps from; the stream's next
    episode, finished in the window, is a record of its own, not cut."""
    samples = [turn(tokenizer, 5, 0, 3, 0.0, False, stream=0),
               turn(tokenizer, 5, 0, 4, 0.0, False, stream=0, cut=True),
               turn(tokenizer, 9, 0, 1, 1.0, True, stream=1, success=True)]
    records = trajectories.episode_records(
        samples, tokenizer, kind="train", step=2, scores={0: 0.5}, kept=samples,
        advantages=torch.zeros(3, 12), step_advantages=torch.tensor([0.1, -0.2, 0.3]),
        bootstrap=torch.tensor([0.0, 0.75, 0.0]))
    cut, whole = records
    assert cut["window"] == {"first_turn": 3, "cut": True, "bootstrap": 0.75}
    assert [t["step_advantage"] for t in cut["turns"]] == pytest.approx([0.1, -0.2])
    assert whole["window"] == {"first_turn": 1, "cut": False, "bootstrap": None}


def test_writes_are_whole_or_nothing_and_newer_schemas_are_refused(tmp_path):
    path = trajectories.step_file(tmp_path, 3)
    assert path == tmp_path / "trajectories" / "step_3.jsonl.gz"
    assert trajectories.step_file(tmp_path, 0, "eval").name == "eval_step_0.jsonl.gz"
    trajectories.write_records(path, [{"schema": 1, "a": 1}])
    with pytest.raises(TypeError):   # a record that cannot be written: the old file stays
        trajectories.write_records(path, [{"schema": 1, "a": 2}, {"bad": object()}])
    assert trajectories.read_records(path) == [{"schema": 1, "a": 1}]
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_3.jsonl.gz"]
    trajectories.write_records(path, [{"schema": 1, "a": 3}])  # a resumed step: replaced
    assert trajectories.read_records(path) == [{"schema": 1, "a": 3}]

    newer = tmp_path / "newer.jsonl.gz"
    with gzip.open(newer, "wt") as f:
        f.write(json.dumps({"schema": 1}) + "\n" + json.dumps({"schema": 99}) + "\n")
    with pytest.raises(ValueError, match=r"newer.jsonl.gz: line 2 has schema 99 .*upgrade"):
        trajectories.read_records(newer)
    garbled = tmp_path / "garbled.jsonl.gz"
    with gzip.open(garbled, "wt") as f:
        f.write("{not json\n")
    with pytest.raises(ValueError, match=r"garbled.jsonl.gz: line 1 is not JSON"):
        trajectories.read_records(garbled)
