"""The whole loop on a tiny model: real Ray, real megatron-core (actor TP=2, critic TP=1), real
SGLang: a run that fails half-built is torn down. (Whole synchronous runs and their resume:
tests/test_resume_equivalence.py; a colocated step with Ray env workers: the mixture-of-experts
run of tests/test_moe.py.)"""
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
