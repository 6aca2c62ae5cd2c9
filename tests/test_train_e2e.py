"""The whole loop on a tiny model: real Ray, real megatron-core (actor TP=2, critic TP=1), real
SGLang: a run that fails half-built is torn down; a colocated step with Ray env workers. (Whole
synchronous runs and their resume: tests/test_resume_equivalence.py.)"""
from __future__ import annotations

import pytest

from ragen_mega.config import load_run_config
from ragen_mega.train import main as train_main, train


def test_malformed_config_fails_before_anything_starts(capsys):
    import ray

    assert train_main(["examples/bandit_cpu_demo.yaml", "actor.tp=0"]) == 2
    assert "config error: actor" in capsys.readouterr().err
    assert not ray.is_initialized()


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
        train(load_run_config("examples/bandit_cpu_demo.yaml", overrides))
    [engines] = started
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{engines.urls[0]}/health", timeout=10)
    # removing the placement group also ends every actor placed in it
    assert [pg["state"] for pg in ray.util.placement_group_table().values()] == ["REMOVED"]


def test_colocated_step_with_env_workers(tiny_run_overrides, tmp_path, private_ray):
    """Colocated mode: the engine shares the trainer's bundles, frees its memory for the train
    phase (a no-op on CPU, the protocol still runs) and takes the new weights through the
    tensor path (shared memory here, CUDA IPC on GPUs) instead of a broadcast. The envs live in
    two Ray env workers here (``rollout.env_workers``). The filter is RAGEN-2's ``min_p`` over
    the groups' mean reward: the step trains on the best-scoring groups' turns only."""
    overrides = tiny_run_overrides(tmp_path, total_steps=1) + [
        "trainer.colocate=true", "trainer.save_every=0", "rollout.env_workers=2",
        "filter.strategy=min_p", "filter.min_p=1.0", "filter.metric=reward",
        "filter.mode=largest", "filter.loss_scaling=linear"]
    history = train(load_run_config("examples/bandit_cpu_demo.yaml", overrides))
    assert [h["step"] for h in history] == [1]
    h = history[0]
    assert h["filter/kept_groups"] >= 1 and h["filter/chosen_score"] >= h["filter/score"]
    assert h["train/batch_samples"] == 2 * h["filter/kept_groups"]  # 2 one-turn episodes each
    assert h["sync/max_logprob_diff"] < 1e-3, h["sync/max_logprob_diff"]
    assert h["weight_version"] == 1 and h["actor/update_successful"] == 1.0
    log = (tmp_path / "logs" / "engine_0.log").read_text()
    for endpoint in ("/release_memory_occupation", "/resume_memory_occupation",
                     "/update_weights_from_tensor"):
        assert endpoint in log, f"engine log shows no {endpoint} call"
    assert "/update_weights_from_distributed" not in log
