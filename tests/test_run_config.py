"""The run config: RAGEN defaults, cross-field rules and errors naming the dotted key."""
from __future__ import annotations

import pathlib

import pytest

from ragen_mega.config import load_run_config
from ragen_mega.config_tree import ConfigError

EXAMPLES = sorted((pathlib.Path(__file__).parents[1] / "examples").glob("*.yaml"))


def test_defaults_are_ragen_starpo_s():
    cfg = load_run_config()
    assert (cfg.env.env_groups, cfg.env.group_size, cfg.env.max_turns) == (8, 16, 5)
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high, cfg.actor.kl_coef) == (0.2, 0.28, 0.0)
    assert (cfg.filter.ratio, cfg.filter.mode) == (0.25, "std")
    assert (cfg.algo.adv_estimator, cfg.algo.gamma, cfg.algo.lam) == ("gae", 1.0, 1.0)
    assert cfg.critic.enable and cfg.critic.lr == 1e-5 and cfg.actor.lr == 1e-6
    assert cfg.actor.clip_ratio_c == 3.0 and cfg.actor.loss_agg_mode == "token-mean"


@pytest.mark.parametrize("overrides, needle", [
    (["actor.lrr=1"], "unknown config key 'actor.lrr'; allowed keys here:"),
    (["actor.tp=0"], "actor.tp: must be an integer >= 1 (got 0)"),
    (["critic.lr=-1"], "critic.lr: must be > 0"),
    (["trainer.data_parallel=0"], "trainer.data_parallel: must be >= 1"),
    (["algo.use_rollout_logprobs=true", "rollout.temperature=0.7"],
     "algo.use_rollout_logprobs: needs rollout.temperature=1.0"),
    (["env.name=chess"], "env.name: unknown env 'chess'; registered envs: babyai, bandit"),
    (["filter.ratio=0"], "filter.ratio: must be in (0, 1]"),
    (["filter.mode=top"], "filter.mode: 'top' is not allowed; allowed values: 'std', 'std_rev'"),
    (["agent.format_penalty=0.5"], "agent: AgentConfig.format_penalty"),
    (["critic.enable=false"], "algo.adv_estimator: 'gae' needs a critic"),
    (["algo.adv_estimator=grpo", "env.group_size=1"], "env.group_size: grpo compares episodes"),
    (["rollout.top_p=0"], "rollout.top_p: must be in (0, 1]"),
    (["env.name=sokoban", "env.kwargs={dim: 3}"], "env.kwargs: env 'sokoban' got unknown kwarg(s) ['dim']"),
])
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, overrides)
    assert needle in str(err.value)


def test_overrides_apply():
    cfg = load_run_config(None, ["env.name=sokoban", "env.kwargs={dim_room: [6, 6]}",
                                 "algo.adv_estimator=grpo", "critic.enable=false",
                                 "actor.lr=1e-5", "agent.think=false"])
    assert cfg.env.name == "sokoban" and cfg.env.kwargs == {"dim_room": [6, 6]}
    assert cfg.actor.lr == 1e-5 and not cfg.agent.think and not cfg.critic.enable


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_load(path):
    load_run_config(path)


@pytest.mark.parametrize("kwargs, field", [
    ({"micro_batch_size": 0}, "micro_batch_size"), ({"clip_ratio_c": 0.5}, "clip_ratio_c"),
    ({"loss_agg_mode": "mean"}, "loss_agg_mode"), ({"kl_kind": "k9"}, "kl_kind"),
    ({"warmup_steps": 10, "total_steps": 5}, "total_steps"), ({"bf16": True}, "bf16")])
def test_trainer_config_errors_name_the_field(kwargs, field):
    """The Megatron trainer refuses a bad TrainerConfig itself too (not only via the tree)."""
    from ragen_mega.config import TrainerConfig

    with pytest.raises(ValueError, match=f"^{field}: "):
        TrainerConfig(**kwargs).validate()
    overrides = [f"critic.{k}={v}" for k, v in kwargs.items()]
    with pytest.raises(ConfigError, match=f"^critic.{field}: "):
        load_run_config(None, overrides)
