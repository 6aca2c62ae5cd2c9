"""``async_mode: one_step_off`` on the whole loop (real Ray, megatron-core, SGLang; tiny model):
step k+1's rollout plays while step k trains, its samples are one weight version stale and
IS-corrected, and a run resumed after step k trains on the very rollout played before the save."""
from __future__ import annotations

import json
import math
import shutil
import threading
import time

from conftest import (TIS_WEIGHTED, resumed_step_diffs, server_killed_under_first_request,
                      server_pids, undocumented_scalars)
from ragen_mega.config import load_run_config
from ragen_mega.rollout.manager import RolloutManager
from ragen_mega.train import train
from ragen_mega.ray.trainer_group import TrainerGroup

DEMO = "examples/bandit_cpu_demo.yaml"


def _timed(monkeypatch, cls, name: str, events: list, label):
    """Wrap ``cls.name`` to append ``(label(args), start, end)`` to ``events``."""
    real = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            events.append((label(self, *args), start, time.perf_counter()))
    monkeypatch.setattr(cls, name, wrapper)


def test_overlapped_rollout_is_one_version_stale_and_resumes_exactly(
        tiny_run_overrides, tmp_path, private_ray, monkeypatch):
    """Three overlapped steps (actor and critic, GAE; weight-sync check after every step), then
    step 3 again from step 2's checkpoint.

    - Overlap: step k+1's rollout starts before step k's actor update ends.
    - Staleness: step 1 trains on its own rollout (weights 0); steps 2 and 3 on rollouts played
      with the weights of two steps back, so the actor's recomputed old log-probs differ from
      the engine's and the truncated IS weight moves off 1; at step 1 both agree.
    - The engines, idle again at the boundary, serve the trainer's weights after each sync.
    - Resume: the checkpoint of step 2 holds step 3's rollout (played with step 1's weights);
      the resumed step 3 equals the straight one (a replayed rollout would be played with step
      2's weights: staleness 0, different log-probs).
    - An engine killed under the resumed run's overlapped rollout of step 4 is brought to the
      trainer's weights by step 3's sync on the main thread, and step 4 is played again there."""
    events: list = []
    _timed(monkeypatch, RolloutManager, "rollout", events,
           lambda rollouts, step, version: ("play", step))
    _timed(monkeypatch, TrainerGroup, "train", events, lambda group, batch: ("train", group.role))
    # unwhitened advantages: the tiny model's constant rewards minus the fresh critic's values
    # move the actor from step 1 on (whitened, they are all 0 until the critic has trained)
    overrides = tiny_run_overrides(tmp_path, 3) + ["trainer.async_mode=one_step_off",
                                                   "actor.tis_cap=2.0", "actor.tp=1",
                                                   "algo.whiten_advantages=false"]
    straight = train(load_run_config(DEMO, overrides))
    assert [h["step"] for h in straight] == [1, 2, 3]

    plays = {label[1]: (start, end) for label, start, end in events if label[0] == "play"}
    actor_trains = [(start, end) for label, start, end in events if label == ("train", "actor")]
    assert sorted(plays) == [1, 2, 3] and len(actor_trains) == 3
    for k in (1, 2):  # played during step k's update, after step k's own rollout
        assert plays[k][1] <= plays[k + 1][0] < actor_trains[k - 1][1], (k, plays, actor_trains)

    assert [h["rollout/weight_staleness"] for h in straight] == [0.0, 1.0, 1.0]
    first, *later = straight
    assert first["train/rollout_vs_trainer_logprob_diff"] < 1e-5
    assert math.isclose(first["actor/tis_weight"], 1.0, abs_tol=1e-5)
    print("engine vs trainer log-prob diff, tis weight by step:",
          [(h["train/rollout_vs_trainer_logprob_diff"], h["actor/tis_weight"]) for h in straight])
    for h in later:
        assert h["train/rollout_vs_trainer_logprob_diff"] > 1e-4, h
        assert abs(h["actor/tis_weight"] - 1.0) > 1e-5, h
    for h in straight:
        assert h["sync/max_logprob_diff"] < 1e-3, h["sync/max_logprob_diff"]
    assert "time/rollout_wait_s" in straight[1] and "time/rollout_wait_s" not in straight[2]
    # docs/metrics.md's table names the overlapped step's scalars too
    assert not undocumented_scalars(straight[1], tags=("bandit",))

    ckpt = tmp_path / "checkpoints"
    for role in ("actor", "critic"):
        shutil.rmtree(ckpt / role / "step_3")
    (ckpt / "latest_step").write_text("2")
    events.clear()
    # the resumed run goes one step further, and its engine dies under step 4's overlapped
    # rollout (played on its own thread while step 3 trains): the restarted engine must not be
    # given weights from that thread (the trainer is mid-update there); step 4 is played again
    # after step 3's sync, which brings the new engine to step 3's weights
    killed = []
    real_rollout = RolloutManager.rollout

    def engine_dies_under_overlapped_rollout(rollouts, step, version):
        if step != 4 or threading.current_thread().name != "overlapped-rollout" or killed:
            return real_rollout(rollouts, step, version)
        killed.append(server_pids(tmp_path)[-1])
        with server_killed_under_first_request(rollouts.engines, killed[-1]):
            return real_rollout(rollouts, step, version)

    monkeypatch.setattr(RolloutManager, "rollout", engine_dies_under_overlapped_rollout)
    longer = [o for o in overrides if not o.startswith("trainer.total_steps=")]
    resumed = train(load_run_config(DEMO, longer + ["trainer.total_steps=4"]))
    assert [h["step"] for h in resumed] == [3, 4]
    # step 3 trained on the saved rollout; step 4's overlapped try met the dead engine, then
    # step 4 was played again on the main thread
    assert [label for label, _, _ in events if label[0] == "play"] == [("play", 4)] * 2
    assert killed and server_pids(tmp_path)[-2] == killed[0]

    want, got = straight[2], resumed[0]
    # what only the resumed run has at step 3: the next step's overlap, the engine restart
    overlap = {"time/rollout_wait_s", "fault/engine_restarts", "fault/episodes_retried"}
    assert set(got) - overlap == set(want) - overlap
    assert got["fault/engine_restarts"] == 1.0
    diffs = resumed_step_diffs({k: v for k, v in want.items() if k not in overlap}, got,
                               weighted=TIS_WEIGHTED)
    assert not diffs, json.dumps(diffs, indent=1)
    step4 = resumed[1]
    # played with the weights of step 3 (staleness 0), on an engine that serves them: its
    # log-probs are the trainer's, as at step 1 (a restarted engine left on the checkpoint it
    # loaded, or given other weights, would differ by > 1e-4 as steps 2-3 do)
    assert step4["rollout/weight_staleness"] == 0.0
    assert step4["train/rollout_vs_trainer_logprob_diff"] < 1e-5, step4
    assert step4["sync/max_logprob_diff"] < 1e-3


def test_overlapped_streams_are_one_version_stale_and_resume_exactly(
        tiny_run_overrides, tmp_path, private_ray, monkeypatch):
    """``rollout.mode: turns`` overlapped: FrozenLake streams (2 groups x 2, episodes of 3
    turns in windows of 2, so episodes are cut and bootstrapped across steps), actor and critic.
    Step k+1's window plays while step k trains, one weight version stale; the checkpoint of
    step 1 holds window 2 and the streams where window 2 left them, so a run resumed there
    trains step 2 on that very window and plays window 3 from there: steps 2 and 3 equal the
    straight run's (streams saved from before window 2 would play its turns again)."""
    events: list = []
    _timed(monkeypatch, RolloutManager, "rollout", events,
           lambda rollouts, step, version: ("play", step))
    _timed(monkeypatch, TrainerGroup, "train", events, lambda group, batch: ("train", group.role))
    overrides = tiny_run_overrides(tmp_path, 3) + [
        "env.name=frozen_lake", "env.kwargs={}", "env.max_turns=3", "rollout.mode=turns",
        "rollout.turns_per_step=2", "agent.memory_turns=1", "algo.gamma=0.99", "algo.lam=0.95",
        "trainer.async_mode=one_step_off", "actor.tis_cap=2.0", "actor.tp=1",
        "algo.whiten_advantages=false"]
    straight = train(load_run_config(DEMO, overrides))
    assert [h["step"] for h in straight] == [1, 2, 3]
    plays = {label[1]: (start, end) for label, start, end in events if label[0] == "play"}
    actor_trains = [(start, end) for label, start, end in events if label == ("train", "actor")]
    for k in (1, 2):  # window k+1 played during step k's update
        assert plays[k][1] <= plays[k + 1][0] < actor_trains[k - 1][1], (k, plays, actor_trains)
    for h in straight:  # 4 streams x 2 turns, every step
        assert h["rollout/samples"] == h["train/batch_samples"] == 8
        assert h["sync/max_logprob_diff"] < 1e-3
    assert [h["rollout/weight_staleness"] for h in straight] == [0.0, 1.0, 1.0]
    assert [h["rollout/episodes_finished"] for h in straight] == [0, 4, 4]
    assert straight[0]["train/rollout_vs_trainer_logprob_diff"] < 1e-5
    for h in straight[1:]:
        assert h["train/rollout_vs_trainer_logprob_diff"] > 1e-4, h
    assert not undocumented_scalars(straight[1], tags=("frozen_lake",))

    ckpt = tmp_path / "checkpoints"
    for step in (2, 3):
        for role in ("actor", "critic"):
            shutil.rmtree(ckpt / role / f"step_{step}")
    (ckpt / "latest_step").write_text("1")
    events.clear()
    resumed = train(load_run_config(DEMO, overrides))
    assert [h["step"] for h in resumed] == [2, 3]
    # step 2 trained on the saved window; only window 3 was played
    assert [label for label, _, _ in events if label[0] == "play"] == [("play", 3)]
    for want, got in zip(straight[1:], resumed):
        diffs = resumed_step_diffs(want, got, weighted=TIS_WEIGHTED)
        assert set(got) == set(want) and not diffs, json.dumps(diffs, indent=1)
