"""The whole loop on a tiny model: real Ray, real megatron-core (actor TP=2, critic TP=1), real
SGLang: a run that fails half-built is torn down. (Whole synchronous runs and their resume:
tests/test_resume_equivalence.py; a colocated step with Ray env workers: the mixture-of-experts
run of tests/test_moe.py.)"""
from __future__ import annotations

import pytest

from ragen_mega.config import load_run_config
from ragen_mega.config_tree import ConfigError
from ragen_mega.train import main as train_main, train

from conftest import perturbed_copy
from user_code_examples import CREDIT, USER_ENV, USER_ESTIMATOR


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


@pytest.fixture()
def user_code(tmp_path):
    """(env path, estimator path): a user's env class and estimator in files of their own."""
    (tmp_path / "coin_game.py").write_text(USER_ENV)
    (tmp_path / "credit.py").write_text(USER_ESTIMATOR)
    return f"{tmp_path}/coin_game.py:Coin", f"{tmp_path}/credit.py:constant_credit"


def test_user_code_paths_are_checked_at_load_naming_the_key(user_code, tmp_path, capsys):
    """A bad env or estimator path is a config error naming the key (exit 2, nothing started);
    a good one loads, with the estimator's own declarations checked (it compares a group's
    episodes and is critic-free)."""
    env, credit = user_code
    base = ["examples/bandit_cpu_demo.yaml", "critic.enable=false"]
    for key, value, problem in (
            ("env.name", f"{tmp_path}/nope.py:Coin", "no file"),
            ("env.name", f"{tmp_path}/coin_game.py:Pebble", "has no 'Pebble'"),
            ("env.name", f"{tmp_path}/credit.py:constant_credit", "is not a TextEnv subclass"),
            ("algo.adv_estimator", "no_such_module_here:f", "importing no_such_module_here"),
            ("algo.adv_estimator", f"{tmp_path}/coin_game.py:nothing", "has no 'nothing'")):
        assert train_main([*base, f"{key}={value}"]) == 2
        err = capsys.readouterr().err
        assert f"config error: {key}: " in err and problem in err, err
    cfg = load_run_config(base[0], [*base[1:], f"env.name={env}", f"algo.adv_estimator={credit}",
                                    "env.kwargs={prize: 2.0}"])
    assert cfg.env.name == env
    with pytest.raises(ConfigError, match="env.group_size: .*compares episodes within a group"):
        load_run_config(base[0], [*base[1:], f"algo.adv_estimator={credit}", "env.group_size=1"])
    with pytest.raises(ConfigError, match="critic.enable: .*is critic-free"):
        load_run_config(base[0], [f"algo.adv_estimator={credit}", "critic.enable=true"])


def test_a_user_env_and_estimator_named_from_yaml_train_a_step(user_code, tiny_model,
                                                               tiny_run_overrides, tmp_path,
                                                               private_ray):
    """``env.name`` and ``algo.adv_estimator`` given as files of the user's: the rollout plays
    the user's game (its rewards in the step's metrics) and the loss is the user's credit: every
    advantage is CREDIT, so the first update's loss (ratio 1, old log-probs recomputed by the
    same actor) is exactly -CREDIT.

    The run starts from ``actor.load``: a perturbed copy of ``model.path`` converted at TP1,
    loaded by the TP2 actor; the first rollout's engine log-probs are those transformers gives
    the perturbed weights, so the checkpoint reached the trainer ranks and the engines served
    it from the first rollout on."""
    import torch

    from ragen_mega.backends.megatron.convert import main as convert_main
    from ragen_mega.rollout.replay import rollout_file

    env, credit = user_code
    log = tmp_path / "resets.txt"
    base = tiny_model("qwen2")
    start = perturbed_copy(base, tmp_path / "start_hf", scale=0.5)
    assert convert_main(["hf-to-megatron", "--hf-dir", str(start), "--out-dir",
                         str(tmp_path / "start")]) == 0
    overrides = tiny_run_overrides(tmp_path / "run", total_steps=1) + [
        f"env.name={env}", f"env.kwargs={{log: '{log}'}}", f"algo.adv_estimator={credit}",
        "critic.enable=false", "trainer.save_every=0", f"actor.load={tmp_path / 'start'}",
        "trainer.save_rollouts=true"]
    [metrics] = train(load_run_config("examples/bandit_cpu_demo.yaml", overrides))
    assert len(log.read_text().split()) == 4  # 2 groups x 2 episodes of the user's game
    assert metrics["actor/pg_loss"] == pytest.approx(-CREDIT, abs=1e-6)
    samples = torch.load(rollout_file(tmp_path / "run", 1), weights_only=True)["samples"]
    engine = torch.tensor([lp for s in samples for lp in s["rollout_logprobs"]])
    assert (engine - _response_logprobs(start, samples)).abs().max() < 1e-3
    assert (engine - _response_logprobs(base, samples)).abs().max() > 0.05


def _response_logprobs(model_dir, samples: list[dict]):
    """transformers' log-prob of each sampled response token (temperature 1), in order."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
            logp = torch.log_softmax(model(ids).logits[0, :-1], -1)
            out.append(logp.gather(-1, ids[0, 1:, None])[-len(s["response_ids"]):, 0])
    return torch.cat(out)
