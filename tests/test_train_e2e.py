"""The whole loop on a tiny model: real Ray, real megatron-core (actor TP=2, critic TP=1), real
SGLang; two StarPO-S steps, then a resumed third step; a colocated step with Ray env workers."""
from __future__ import annotations

import json
import math
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import readme_scalars
from ragen_mega.config import load_run_config
from ragen_mega.ray import checkpoints, driver


def test_malformed_config_fails_before_anything_starts(capsys):
    import ray

    assert driver.main(["examples/bandit_cpu_demo.yaml", "actor.tp=0"]) == 2
    assert "config error: actor" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_two_steps_then_resume(tiny_run_overrides, tmp_path, private_ray):
    overrides = tiny_run_overrides(tmp_path, total_steps=2)
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
    # verl's names for verl's quantities (RAGEN publishes the same)
    for tag in ("rollout/success", "rollout/reward_mean", "actor/pg_loss", "actor/grad_norm",
                "actor/entropy", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl",
                "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "filter/kept_groups",
                "filter/in_group_std", "time/rollout_s", "sync/seconds"):
        assert tag in tags, f"missing scalar {tag}"
    for tag in tags:
        assert all(math.isfinite(e.value) for e in acc.Scalars(tag)), tag
    # README's table names every scalar the loop writes (per-env-tag copies as rollout/<tag>/...)
    documented = readme_scalars()
    for tag in tags:
        generic = re.sub(r"^val/", "rollout/", re.sub(r"pass@\d+", "pass@k", tag))
        generic = re.sub(r"^rollout/bandit/", "rollout/<tag>/", generic)
        assert generic in documented or re.sub(r"/<tag>/", "/", generic) in documented, tag
    # one pointer, directories named by the loop's step, no per-role pointer
    assert checkpoints.latest_complete_step(tmp_path) == 2
    for role in ("actor", "critic"):
        assert sorted(p.name for p in (tmp_path / "checkpoints" / role).iterdir()) == [
            "step_1", "step_2"]

    # resume: a third step continues from the saved step 2 (weights and optimizer restored)
    cfg3 = load_run_config("examples/bandit_cpu_demo.yaml", tiny_run_overrides(tmp_path, 3))
    history3 = driver.train(cfg3)
    assert [h["step"] for h in history3] == [3]
    assert history3[0]["sync/max_logprob_diff"] < 1e-3
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3]


def test_half_built_run_is_torn_down(tiny_model, tiny_run_overrides, tmp_path, private_ray,
                                     monkeypatch):
    """The engine is up when the actor fails to build (one attention head cannot be split over
    actor.tp=2): the error reaches the caller, and the engine's server, the trainer ranks and
    the placement group are gone."""
    import ray
    import requests

    from ragen_mega.ray.engine_group import EngineGroup

    started, real_init = [], EngineGroup.__init__

    def recording_init(self, *args, **kwargs):  # the real engines, remembered for the check
        real_init(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(EngineGroup, "__init__", recording_init)
    one_head = tiny_model("qwen2", num_heads=1, num_kv_heads=1)
    overrides = tiny_run_overrides(tmp_path, total_steps=1) + [f"model.path={one_head}"]
    with pytest.raises(RuntimeError, match="on rank 0"):
        driver.train(load_run_config("examples/bandit_cpu_demo.yaml", overrides))
    [engines] = started
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{engines.urls[0]}/health", timeout=10)
    # removing the placement group also ends every actor placed in it
    assert [pg["state"] for pg in ray.util.placement_group_table().values()] == ["REMOVED"]


def test_colocated_step_with_env_workers(tiny_run_overrides, tmp_path, private_ray):
    """Colocated mode: the engine shares the trainer's bundles, frees its memory for the train
    phase (a no-op on CPU, the protocol still runs) and takes the new weights through the
    tensor path (shared memory here, CUDA IPC on GPUs) instead of a broadcast. The envs live in
    two Ray env workers here (``rollout.env_workers``)."""
    overrides = tiny_run_overrides(tmp_path, total_steps=1) + [
        "trainer.colocate=true", "trainer.save_every=0", "rollout.env_workers=2"]
    history = driver.train(load_run_config("examples/bandit_cpu_demo.yaml", overrides))
    assert [h["step"] for h in history] == [1]
    h = history[0]
    assert h["sync/max_logprob_diff"] < 1e-3, h["sync/max_logprob_diff"]
    assert h["weight_version"] == 1 and h["actor/update_successful"] == 1.0
    log = (tmp_path / "logs" / "engine_0.log").read_text()
    for endpoint in ("/release_memory_occupation", "/resume_memory_occupation",
                     "/update_weights_from_tensor"):
        assert endpoint in log, f"engine log shows no {endpoint} call"
    assert "/update_weights_from_distributed" not in log
