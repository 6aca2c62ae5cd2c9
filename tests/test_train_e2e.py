"""The whole loop on a tiny model: real Ray, real megatron-core (actor TP=2, critic TP=1), real
SGLang; two StarPO-S steps, then a resumed third step."""
from __future__ import annotations

import json
import math
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ragen_mega.config import load_run_config
from ragen_mega.ray import driver


def test_malformed_config_fails_before_anything_starts(capsys):
    import ray

    assert driver.main(["examples/bandit_cpu_demo.yaml", "actor.tp=0"]) == 2
    assert "config error: actor" in capsys.readouterr().err
    assert not ray.is_initialized()


@pytest.fixture
def private_ray(monkeypatch, tmp_path_factory):
    import tempfile

    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="rm_ray_"))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    yield
    import ray

    ray.shutdown()


def test_two_steps_then_resume(tiny_model, tmp_path, private_ray):
    model = tiny_model("qwen2")
    overrides = [
        f"model.path={model}", f"trainer.run_dir={tmp_path}", "trainer.total_steps=2",
        "trainer.save_every=1", "trainer.check_weight_sync=true", "trainer.eval_every=0",
        "env.name=bandit", "env.env_groups=2", "env.group_size=2", "env.max_turns=1",
        "agent.think=false", "agent.max_actions_per_turn=1", "rollout.max_new_tokens=6",
        "filter.ratio=1.0", "algo.adv_estimator=gae", "algo.use_rollout_logprobs=false",
        "critic.enable=true", "actor.tp=2", "actor.lr=1e-3",
        "actor.micro_batch_size=2", "critic.micro_batch_size=2", "critic.lr=1e-3"]
    cfg = load_run_config("examples/bandit_cpu_demo.yaml", overrides)
    history = driver.train(cfg)
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        # the engines serve exactly the trainer's new weights after every sync
        assert h["sync/max_logprob_diff"] < 1e-3, h["sync/max_logprob_diff"]
        assert h["weight_version"] == h["step"]
        # the log-probs the trainer recomputes are the engine's sampled ones (fp32 both sides)
        assert h["train/rollout_vs_trainer_logprob_diff"] < 1e-3
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("rollout/success", "rollout/reward_mean", "actor/pg_loss", "actor/grad_norm",
                "actor/entropy", "critic/value_loss", "filter/kept_groups", "time/rollout_s",
                "rollout/group_reward_std_before_filter", "sync/seconds"):
        assert tag in tags, f"missing scalar {tag}"
    for tag in tags:
        assert all(math.isfinite(e.value) for e in acc.Scalars(tag)), tag
    assert (tmp_path / "checkpoints" / "latest_step").read_text() == "2"

    # resume: a third step continues from the saved step 2 (weights and optimizer restored)
    cfg3 = load_run_config("examples/bandit_cpu_demo.yaml",
                           overrides[:2] + ["trainer.total_steps=3"] + overrides[3:])
    history3 = driver.train(cfg3)
    assert [h["step"] for h in history3] == [3]
    assert history3[0]["sync/max_logprob_diff"] < 1e-3
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3]
