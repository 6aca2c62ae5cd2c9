"""Streamed steps (``rollout.mode: turns``) through the whole loop on a tiny model: real Ray (env
streams in two env workers), Megatron actor TP=2 and critic, SGLang; then exact resume.

Crafter, two seed groups of two streams, 4 turns per stream per step: group 0 plays episodes of
up to 300 turns (they go on across all steps), group 1 the same env with a 3-turn limit (its
episodes end inside steps and are followed by the next). The tiny random model never writes a
valid action, so every turn is a format penalty and the crafter world does not move; what is
checked is the streams' bookkeeping and the resume. The resumed step also loses its SGLang
server under its first request: the engine is restarted and resynced and the window played again
from its start, and the step still equals the uninterrupted run's.
"""
from __future__ import annotations

import json
import math
import re
import shutil

from conftest import documented_scalars, server_killed_under_first_request, server_pids
from ragen_mega.backends.megatron.checkpoint import read_checkpoint_state
from ragen_mega.config import load_run_config
from ragen_mega.rollout.manager import RolloutManager
from ragen_mega.train import train
from ragen_mega import checkpoints

DEMO = "examples/bandit_cpu_demo.yaml"
MIX = ("env.mix=[{tag: crafter, kwargs: {max_steps: 400}, env_groups: 1, max_turns: 300},"
       " {tag: crafter_short, name: crafter, env_groups: 1, max_turns: 3}]")


def streamed_overrides(tiny_run_overrides, run_dir, total_steps):
    return tiny_run_overrides(run_dir, total_steps) + [
        MIX, "env.max_turns=300", "rollout.mode=turns", "rollout.turns_per_step=4",
        "rollout.env_workers=2", "agent.memory_turns=1", "algo.gamma=0.99", "algo.lam=0.95"]


def test_streamed_steps_then_exact_resume(tiny_run_overrides, tmp_path, private_ray,
                                          monkeypatch):
    straight = train(load_run_config(DEMO, streamed_overrides(tiny_run_overrides,
                                                                     tmp_path, 3)))
    assert [h["step"] for h in straight] == [1, 2, 3]
    for h in straight:
        # every step trains exactly streams x turns_per_step = 4 x 4 turn samples
        assert h["rollout/samples"] == h["train/batch_samples"] == 16
        assert h["rollout/crafter/samples"] == h["rollout/crafter_short/samples"] == 8
        # sampled with the weights of the step before, trained right after: no staleness
        assert h["rollout/weight_staleness"] == 0.0
        assert h["rollout/crafter/episodes_finished"] == 0
        assert h["rollout/crafter_short/episode_length"] == 3.0
        assert all(math.isfinite(v) for v in h.values())
    # 3-turn episodes in 4-turn windows: each short stream ends episode 0 in step 1, 1 in
    # step 2, 2 and 3 in step 3
    assert [h["rollout/crafter_short/episodes_finished"] for h in straight] == [2, 2, 4]
    assert [h["rollout/episodes_finished"] for h in straight] == [2, 2, 4]
    # where the streams stand after step 3 (saved with it): the long episodes are 12 turns in,
    # the short streams are at their 5th episode (index 4), none of its turns played yet
    state = read_checkpoint_state(checkpoints.step_dir(tmp_path, "actor", 3))["extra"]["streams"]
    assert state["episodes"] == [0, 0, 4, 4]
    assert [len(r) for r in state["responses"]] == [12, 12, 0, 0]
    # docs/metrics.md's table names every scalar a streamed step writes too
    documented = documented_scalars()
    for key in set(straight[0]) - {"step"}:
        generic = re.sub(r"pass@\d+", "pass@k", key)
        generic = re.sub(r"^rollout/(crafter|crafter_short)/", "rollout/<tag>/", generic)
        generic = re.sub(r"^filter/(crafter|crafter_short)/", "filter/<tag>/", generic)
        assert generic in documented or re.sub(r"/<tag>/", "/", generic) in documented, key

    # killed after step 2's checkpoint; the resumed run replays the streams into step 3
    ckpt = tmp_path / "checkpoints"
    for role in ("actor", "critic"):
        shutil.rmtree(ckpt / role / "step_3")
    (ckpt / "latest_step").write_text("2")
    real_rollout, killed = RolloutManager.window, []

    def engine_dies(rollouts, step, faults, weight_version):
        killed.append(server_pids(tmp_path)[-1])
        with server_killed_under_first_request(rollouts.engines, killed[-1]):
            return real_rollout(rollouts, step, faults, weight_version)

    monkeypatch.setattr(RolloutManager, "window", engine_dies)
    resumed = train(load_run_config(DEMO, streamed_overrides(tiny_run_overrides,
                                                                    tmp_path, 3)))
    assert [h["step"] for h in resumed] == [3]
    want, got = straight[2], resumed[0]
    assert set(got) == set(want)
    # the resumed run's server died under step 3's first request: restarted once, all 4
    # streams' windows played again (the restarted server's pid is the next one logged)
    assert server_pids(tmp_path)[-2] == killed[0]
    assert (got["fault/engine_restarts"], got["fault/episodes_retried"]) == (1.0, 4.0)
    assert want["fault/engine_restarts"] == want["fault/episodes_retried"] == 0.0
    got = {**got, "fault/engine_restarts": 0.0, "fault/episodes_retried": 0.0}
    engine_logprobs = {"train/rollout_vs_trainer_logprob_diff", "sync/max_logprob_diff"}
    compared = [k for k in want if not k.startswith("time/") and k != "sync/seconds"]
    diffs = {k: (want[k], got[k]) for k in compared
             if not (math.isclose(got[k], want[k], rel_tol=0, abs_tol=1e-4)
                     if k in engine_logprobs else got[k] == want[k])}
    assert not diffs, json.dumps(diffs, indent=1)
    assert got["critic/vf_loss"] != straight[1]["critic/vf_loss"]
    assert read_checkpoint_state(checkpoints.step_dir(tmp_path, "actor", 3))["extra"][
        "streams"] == state
