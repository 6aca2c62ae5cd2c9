"""The run config: RAGEN defaults, cross-field rules and errors naming the dotted key."""
from __future__ import annotations

import pathlib

import pytest
import yaml

from ragen_mega.algo.filter import default_mode
from ragen_mega.config import load_run_config
from ragen_mega.config_tree import ConfigError

EXAMPLES = sorted((pathlib.Path(__file__).parents[1] / "examples").glob("*.yaml"))


def test_defaults_are_ragen_starpo_s():
    cfg = load_run_config()
    assert (cfg.env.env_groups, cfg.env.group_size, cfg.env.max_turns) == (8, 16, 5)
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high, cfg.actor.kl_coef) == (0.2, 0.28, 0.0)
    assert (cfg.filter.ratio, cfg.filter.metric, cfg.filter.mode) == (0.25, "reward_std", None)
    assert default_mode(cfg.filter.metric) == "std"  # unset: StarPO-S's largest reward std
    assert (cfg.algo.adv_estimator, cfg.algo.gamma, cfg.algo.lam) == ("gae", 1.0, 1.0)
    assert cfg.critic.enable and cfg.critic.lr == 1e-5 and cfg.actor.lr == 1e-6
    assert cfg.actor.clip_ratio_c == 3.0 and cfg.actor.loss_agg_mode == "token-mean"


@pytest.mark.parametrize("overrides, needle", [
    (["actor.lrr=1"], "unknown config key 'actor.lrr'; allowed keys here:"),
    (["actor.tp=0"], "actor.tp: must be >= 1, got 0"),
    (["critic.lr=-1"], "critic.lr: must be > 0"),
    (["trainer.data_parallel=0"], "trainer.data_parallel: must be >= 1"),
    (["algo.use_rollout_logprobs=true", "rollout.temperature=0.7"],
     "algo.use_rollout_logprobs: needs rollout.temperature=1.0"),
    (["algo.use_rollout_logprobs=true", "actor.bf16=true"],
     "algo.use_rollout_logprobs: needs fp32 engines and actor (model.dtype=float32, "
     "actor.bf16=false)"),
    (["algo.use_rollout_logprobs=true", "model.dtype=bfloat16"],
     "got model.dtype=bfloat16, actor.bf16=False"),
    (["env.name=chess"], "env.name: unknown env 'chess'; registered envs: babaisai, babyai, bandit"),
    (["filter.ratio=0"], "filter.ratio: must be in (0, 1]"),
    (["filter.mode=top"], "filter.mode: 'top' is not allowed; allowed values: 'std', 'std_rev'"),
    (["agent.format_penalty=0.5"], "agent.format_penalty: is added to the reward, so it must "
                                   "be <= 0"),
    (["critic.enable=false"], "algo.adv_estimator: 'gae' needs a critic"),
    (["algo.adv_estimator=ppo"], "algo.adv_estimator: unknown advantage estimator 'ppo'; "
                                 "registered: gae, gigpo, grpo, or a function of yours as "
                                 "MODULE:FUNCTION or FILE.py:FUNCTION"),
    (["algo.adv_estimator=grpo", "env.group_size=1"], "env.group_size: grpo compares episodes"),
    (["rollout.top_p=0"], "rollout.top_p: must be in (0, 1]"),
    (["rollout.mem_fraction=1.5"], "rollout.mem_fraction: must be in (0, 1) (or null"),
    (["rollout.env_workers=-1"], "rollout.env_workers: must be >= 0 (0: envs in the driver)"),
    (["rollout.env_workers=2.5"], "rollout.env_workers: expected int, got float 2.5"),
    # enumerations list their choices
    (["actor.lr_decay_style=exp"], "actor.lr_decay_style: 'exp' is not allowed; allowed values: "
                                   "'constant', 'linear', 'cosine', 'inverse-square-root'"),
    (["actor.kl_kind=k9"], "actor.kl_kind: 'k9' is not allowed; allowed values: 'k1', 'kl',"),
    (["critic.loss_agg_mode=mean"], "critic.loss_agg_mode: 'mean' is not allowed; allowed values: "
                                    "'token-mean', 'episode-mean-token-mean',"),
    # each role has only its own loss settings; what the run derives is no key at all
    (["critic.clip_ratio_low=0.1"], "unknown config key 'critic.clip_ratio_low'"),
    (["critic.kl_coef=0.1"], "unknown config key 'critic.kl_coef'"),
    (["actor.value_clip=0.2"], "unknown config key 'actor.value_clip'"),
    (["actor.total_steps=5"], "unknown config key 'actor.total_steps'"),
    (["actor.temperature=0.5"], "unknown config key 'actor.temperature'"),
    (["critic.seed=3"], "unknown config key 'critic.seed'"),
    # the LR warm-up is lr_warmup_steps; warmup_steps is the critic's critic-only steps
    (["actor.warmup_steps=3"], "'actor.warmup_steps' was renamed: write 'actor.lr_warmup_steps'"),
    (["actor.lr_warmup_steps=-1"], "actor.lr_warmup_steps: must be >= 0"),
    (["critic.warmup_steps=-1"], "critic.warmup_steps: must be >= 0 (critic-only steps"),
    (["critic.warmup_steps=5", "trainer.total_steps=5"],
     "critic.warmup_steps: must be < trainer.total_steps=5 (else the actor never trains)"),
    (["critic.warmup_steps=2", "critic.enable=false", "algo.adv_estimator=grpo"],
     "critic.warmup_steps: critic-only steps need a critic"),
    (["critic.highlight_first=0.5"], "critic.highlight_first: must be >= 1.0"),
    # streamed steps: a turn budget per stream, and only what works on unfinished episodes
    (["rollout.mode=turns"], "rollout.turns_per_step: must be an integer >= 1 with "
                             "rollout.mode=turns"),
    (["rollout.mode=turns", "rollout.turns_per_step=0"], "rollout.turns_per_step: must be"),
    (["rollout.mode=stream"], "rollout.mode: 'stream' is not allowed; allowed values: "
                              "'episodes', 'turns'"),
    (["rollout.mode=turns", "rollout.turns_per_step=4", "algo.adv_estimator=grpo",
      "critic.enable=false"], "algo.adv_estimator: rollout.mode=turns needs gae"),
    (["rollout.mode=turns", "rollout.turns_per_step=4", "algo.reward_norm=mean_std"],
     "algo.reward_norm: rollout.mode=turns needs identity"),
    # overlapped rollout: separate engines, the stale samples IS-corrected
    (["actor.tis_cap=0"], "actor.tis_cap: must be > 0"),
    (["trainer.async_mode=one_step_off", "trainer.colocate=true", "actor.tis_cap=2"],
     "trainer.async_mode: trainer.async_mode=one_step_off plays rollouts while the trainer "
     "trains and needs separate engines"),
    (["trainer.async_mode=fully", "actor.tis_cap=2", "trainer.max_staleness=0"],
     "trainer.max_staleness"),
    (["trainer.async_mode=one_step_off", "algo.use_rollout_logprobs=true", "actor.tis_cap=2"],
     "algo.use_rollout_logprobs: with trainer.async_mode=one_step_off the engine's log-probs "
     "are of older weights"),
    (["trainer.async_mode=fully", "actor.tis_cap=2", "actor.lora.rank=8",
      "actor.lora.sync=native"], "actor.lora.sync: native with trainer.async_mode=fully"),
    (["trainer.colocate=true", "actor.lora.rank=8", "actor.lora.sync=native"],
     "actor.lora.sync: native with trainer.colocate=true"),
    # the rollout filter (RAGEN-2's strategies): each value read by its strategy only
    (["filter.strategy=top_q"], "filter.strategy: must be one of ['min_p', 'top_k', 'top_p']"),
    (["filter.strategy=top_p", "filter.top_p=1.5"], "filter.top_p: must be in (0, 1], got 1.5"),
    (["filter.strategy=top_p", "filter.top_p=0"], "filter.top_p: must be in (0, 1], got 0"),
    (["filter.min_p=0.5"], "filter.min_p: read only by filter.strategy=min_p, and the "
                           "strategy is 'top_k'"),
    (["filter.metric=variance"], "filter.metric: must be one of ['entropy', 'length', "
                                 "'reward', 'reward_std', 'reward_variance']"),
    (["filter.metric=entropy", "filter.mode=std"], "filter.mode: 'std' means largest reward "
                                                   "std; with filter.metric=entropy say largest "
                                                   "or smallest"),
    (["filter.selection_eps=-0.1"], "filter.selection_eps: must be >= 0"),
    (["filter.loss_scaling=log"], "filter.loss_scaling: 'log' is not allowed"),
    (["filter.soft_reweight=true"], "filter.soft_reweight: weighs a group's advantages by its "
                                    "reward std"),
    (["algo.kl_in_reward=-0.1"], "algo.kl_in_reward: must be in [0, inf) (0: off)"),
    # collapse probes need reasoning to cross-score, and other groups' prompts
    (["trainer.collapse_every=5", "agent.think=false"], "trainer.collapse_every: the collapse "
                                                        "probes cross-score each answer's "
                                                        "reasoning"),
    (["trainer.collapse_every=5", "env.env_groups=1"], "trainer.collapse_every: the probes "
                                                       "score each reasoning against"),
    (["trainer.collapse_every=-1"], "trainer.collapse_every: must be >= 0"),
    (["trainer.collapse_samples=0"], "trainer.collapse_samples: must be >= 1"),
    # env servers: URLs, one env, no env workers beside them
    (["env.remote=[localhost:8000]"], "env.remote[0]: must be an http(s):// URL of an env "
                                      "server, got 'localhost:8000'"),
    (["env.remote=[http://h:1]", "env.val_name=sokoban"], "env.remote: env servers serve one "
                                                          "env"),
    (["env.remote=[http://h:1]", "env.remote_timeout_s=0"], "env.remote_timeout_s: must be > 0"),
    (["env.remote=[http://h:1]", "rollout.env_workers=2"], "env.remote: episodes play on env "
                                                           "servers"),
    (["model.path=/nonexistent/model"],
     "model.path: '/nonexistent/model' is not a Hugging Face model directory (no config.json"),
])
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, overrides)
    assert needle in str(err.value)


def test_filter_defaults_follow_the_metric_and_the_strategy():
    """A default never makes another key's legal value an error: RAGEN-2's recommended filter
    written as a user would (strategy and metric only) loads, with RAGEN-2's 0.9 and the order
    that metric means; a value the user wrote keeps its refusal (the parametrized cases above)."""
    import torch

    from ragen_mega.algo.filter import FILTER_SETTINGS, select_groups

    # group g's members score 0 and 2g (reward std g * sqrt(2), variance 2 g^2): 10 groups
    rewards = torch.tensor([float(x) for g in range(10) for x in (0, 2 * g)])
    groups = torch.arange(10).repeat_interleave(2)

    def kept(overrides):
        cfg = load_run_config(None, overrides)
        settings = {key: getattr(cfg.filter, key) for key in FILTER_SETTINGS}
        return select_groups(rewards, groups, **settings).kept_group_ids.tolist()

    # RAGEN-2's: variances 2 g^2 sum to 570; 0.9 of it less eps is reached by groups 9..4
    # (162 + 128 + 98 + 72 + 50 + 32 = 542 >= 512.99; 9..5 hold 510)
    assert kept(["filter.strategy=top_p", "filter.metric=reward_variance"]) == [4, 5, 6, 7, 8, 9]
    # min_p 0.9: the groups whose std is at least 0.9 of the best (9 sqrt 2): only 9
    assert kept(["filter.strategy=min_p"]) == [9]
    assert kept(["filter.metric=reward", "filter.ratio=0.2"]) == [8, 9]  # largest mean reward
    assert kept(["filter.metric=reward", "filter.mode=smallest", "filter.ratio=0.2"]) == [0, 1]
    assert kept(["filter.strategy=top_p", "filter.top_p=0.1", "filter.metric=reward_variance"]
                ) == [9]


def test_overrides_apply():
    cfg = load_run_config(None, ["env.name=sokoban", "env.kwargs={dim_room: [6, 6]}",
                                 "algo.adv_estimator=grpo", "critic.enable=false",
                                 "actor.lr=1e-5", "agent.think=false"])
    assert cfg.env.name == "sokoban" and cfg.env.kwargs == {"dim_room": [6, 6]}
    assert cfg.actor.lr == 1e-5 and not cfg.agent.think and not cfg.critic.enable
    assert load_run_config().rollout.env_workers == 0  # envs in the driver unless asked
    assert load_run_config(None, ["rollout.env_workers=8"]).rollout.env_workers == 8


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_load(path):
    """Every example loads. Most name a model directory of the user's machine (/path/to/...):
    until it exists, that key, and only that one, is refused; a preset name is always taken."""
    from ragen_mega.models.prepare import PRESETS

    model = yaml.safe_load(path.read_text())["model"]["path"]
    if model not in PRESETS and not (pathlib.Path(model) / "config.json").is_file():
        with pytest.raises(ConfigError, match="^model.path: "):
            load_run_config(path)
        load_run_config(path, ["model.path=smollm2"])
    else:
        load_run_config(path)


def test_model_path_that_is_no_hf_dir_is_a_cli_config_error(tmp_path, capsys):
    from ragen_mega.train import main

    assert main(["examples/bandit_cpu_demo.yaml", f"model.path={tmp_path}"]) == 2
    assert f"config error: model.path: '{tmp_path}' is not a Hugging Face" in capsys.readouterr().err


def test_yaml_syntax_error_is_a_cli_config_error(tmp_path, capsys):
    """``ragen-mega train`` and ``ragen-mega eval`` report a config file PyYAML cannot parse
    as a config error naming the file and the position (exit 2), not a traceback, before
    anything starts."""
    import ray

    from ragen_mega.evaluate import main as eval_main
    from ragen_mega.train import main

    path = tmp_path / "bad.yaml"
    path.write_text("env: [unclosed")
    want = f"config error: config file '{path}' is not valid YAML: line 1, column 15: "
    assert main([str(path)]) == 2
    assert f"ragen-mega train: {want}" in capsys.readouterr().err
    assert eval_main([str(path), "--checkpoint", "smollm2"]) == 2
    assert f"ragen-mega eval: {want}" in capsys.readouterr().err
    assert not ray.is_initialized()


@pytest.mark.parametrize("section, kwargs, field", [
    ("actor", {"micro_batch_size": 0}, "micro_batch_size"),
    ("actor", {"clip_ratio_c": 0.5}, "clip_ratio_c"), ("actor", {"kl_kind": "k9"}, "kl_kind"),
    ("critic", {"loss_agg_mode": "mean"}, "loss_agg_mode"),
    ("critic", {"value_clip": 0}, "value_clip")])
def test_training_section_errors_name_the_field(section, kwargs, field):
    """The Megatron trainer refuses a bad section itself too (not only via the tree)."""
    from ragen_mega.config import ActorConfig, CriticConfig

    with pytest.raises(ValueError, match=f"^{field}: "):
        {"actor": ActorConfig, "critic": CriticConfig}[section](**kwargs).validate()
    overrides = [f"{section}.{k}={v}" for k, v in kwargs.items()]
    with pytest.raises(ConfigError, match=f"^{section}.{field}: "):
        load_run_config(None, overrides)


MIX = ("env.mix=[{tag: sokoban, kwargs: {dim_room: [6, 6]}, env_groups: 3},"
       " {tag: lake, name: frozen_lake, kwargs: {is_slippery: false}, env_groups: 2, val_groups: 4},"
       " {tag: big, name: sokoban, kwargs: {dim_room: [8, 8]}, env_groups: 0, max_turns: 12}]")


def test_env_mix_parts():
    """A mixed run: training parts in order (eval-only entry left out), eval parts with each
    entry's val_groups (default: env.val_groups), the env name defaulting to the tag, an
    entry's own max_turns carried (None: env.max_turns applies)."""
    from ragen_mega.rollout.seeding import EnvPart, train_parts, val_parts

    cfg = load_run_config(None, [MIX, "env.env_groups=5", "env.val_groups=7"])
    assert train_parts(cfg.env) == [
        EnvPart("sokoban", "sokoban", {"dim_room": [6, 6]}, 3),
        EnvPart("lake", "frozen_lake", {"is_slippery": False}, 2)]
    assert val_parts(cfg.env) == [
        EnvPart("sokoban", "sokoban", {"dim_room": [6, 6]}, 7),
        EnvPart("lake", "frozen_lake", {"is_slippery": False}, 4),
        EnvPart("big", "sokoban", {"dim_room": [8, 8]}, 7, max_turns=12)]


def test_single_env_parts():
    """The simple form is one part tagged with the env's name; a different eval env does not
    inherit the training env's kwargs (sokoban's dim_room would break frozen_lake)."""
    from ragen_mega.rollout.seeding import EnvPart, train_parts, val_parts

    cfg = load_run_config(None, ["env.name=sokoban", "env.kwargs={dim_room: [6, 6]}",
                                 "env.env_groups=2", "env.val_groups=3"])
    assert train_parts(cfg.env) == [EnvPart("sokoban", "sokoban", {"dim_room": [6, 6]}, 2)]
    assert val_parts(cfg.env) == [EnvPart("sokoban", "sokoban", {"dim_room": [6, 6]}, 3)]
    cfg = load_run_config(None, ["env.name=sokoban", "env.kwargs={dim_room: [6, 6]}",
                                 "env.val_name=frozen_lake"])
    assert val_parts(cfg.env) == [EnvPart("frozen_lake", "frozen_lake", {}, 16)]


def _entry(**fields):
    base = {"tag": "sokoban", "env_groups": 8}
    return {**base, **fields}


@pytest.mark.parametrize("mix, extra, needle", [
    ([_entry(name="chess")], [], "env.mix[0].name: unknown env 'chess'; registered envs: babaisai, babyai"),
    ([_entry(tag="SimpleSokoban")], [],
     "env.mix[0].tag (no name given, so the tag names the env): unknown env 'SimpleSokoban'"),
    ([_entry(env_groups=4), _entry(env_groups=4)], [], "env.mix[1].tag: duplicate tag 'sokoban'"),
    ([_entry(env_groups=4)], [], "env.env_groups: 8 but the env.mix entries' env_groups sum to 4"),
    ([_entry(tag="a/b", name="sokoban")], [], "env.mix[0].tag: 'a/b' must be a non-empty name"),
    ([_entry(tag="", name="sokoban")], [], "env.mix[0].tag: '' must be a non-empty name"),
    ([_entry(env_groups=9), _entry(tag="lake", name="frozen_lake", env_groups=-1)], [],
     "env.mix[1].env_groups: must be >= 0, got -1"),
    ([_entry(), _entry(tag="lake", name="frozen_lake", env_groups=0, val_groups=0)], [],
     "env.mix[1]: env_groups and val_groups are both 0"),
    ([_entry(val_groups=0)], [], "env.mix: every entry has val_groups: 0"),
    ([_entry()], ["env.name=sokoban"], "env.name: 'sokoban' is not used when env.mix is set"),
    ([_entry()], ["env.val_name=frozen_lake"], "env.val_name: 'frozen_lake' is not used when"),
    ([_entry(groups=8)], [], "unknown config key 'env.mix[0].groups'; allowed keys here: "
                             "env_groups, kwargs, max_turns, name, tag, val_groups"),
    ([_entry(max_turns=0)], [], "env.mix[0].max_turns: must be >= 1 (leave it out to use "
     "env.max_turns), got 0"),
    ([_entry(env_groups="four")], [], "env.mix[0].env_groups: expected int, got str 'four'"),
])
def test_env_mix_errors_name_the_key(mix, extra, needle):
    import json

    with pytest.raises(ConfigError) as err:
        load_run_config(None, [f"env.mix={json.dumps(mix)}", *extra])
    assert needle in str(err.value)


@pytest.mark.parametrize("overrides, needle", [
    (["env.name=sokoban", "env.kwargs={dim: 3}"],
     "env.kwargs: env 'sokoban' got unknown kwarg(s) ['dim']"),
    (["env.val_name=frozen_lake", "env.val_kwargs={size: 1}"], "env.val_kwargs: "),
    ([f"env.mix=[{{tag: sokoban, env_groups: 4}}, {{tag: lake, name: frozen_lake, "
      f"kwargs: {{size: 1}}, env_groups: 4}}]"], "env.mix[1].kwargs: "),
    (["env.mix=[{tag: sokoban, kwargs: {dim: 3}, env_groups: 8}]"],
     "env.mix[0].kwargs: env 'sokoban' got unknown kwarg(s) ['dim']"),
    (["actor.bf16=true"], "actor.bf16: bf16 training needs a GPU; on a CPU it learns slower "
     "per step"),
    (["critic.bf16=true"], "critic.bf16: bf16 training needs a GPU; on a CPU"),
    (["actor.moe_grouped_gemm=true"], "actor.moe_grouped_gemm: grouped-GEMM experts are "
     "TransformerEngine's TEGroupedMLP, which needs TransformerEngine on a GPU"),
])
def test_preflight_checks_what_loading_does_not(overrides, needle, monkeypatch):
    """Loading validates the tree alone; the start-up check builds every env once and looks
    for a GPU, naming the key (the machine is made GPU-less, so a GPU host runs the same)."""
    import torch

    from ragen_mega.preflight import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    cfg = load_run_config(None, overrides)  # no env built, no device probed
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    assert needle in str(err.value)


def test_cli_runs_the_preflight_before_anything_starts(capsys):
    import ray

    from ragen_mega.evaluate import main as eval_main
    from ragen_mega.sft import main as sft_main
    from ragen_mega.train import main as train_main

    bad = ["examples/bandit_cpu_demo.yaml", "env.kwargs={arms: 3}"]
    for name, main in (("train", train_main), ("eval", eval_main), ("sft", sft_main)):
        argv = bad + (["--checkpoint", "smollm2"] if name == "eval" else [])
        assert main(argv) == 2
        assert f"ragen-mega {name}: config error: env.kwargs: " in capsys.readouterr().err
    assert not ray.is_initialized()


@pytest.mark.parametrize("override, key", [
    ("trainer.eval_every=5", "trainer.eval_every"),
    ("trainer.async_mode=one_step_off", "trainer.async_mode"),
    ("trainer.check_weight_sync=true", "trainer.check_weight_sync"),
    ("trainer.colocate=true", "trainer.colocate"),
    ("rollout.mode=turns rollout.turns_per_step=4", "rollout.mode"),
    ("trainer.run_dir=runs/old", "trainer.replay_rollouts")])
def test_a_replayed_run_refuses_what_needs_an_engine(override, key):
    """``trainer.replay_rollouts`` starts no engine: what would need one is refused by name,
    and so is replaying into the run directory the rollouts are read from."""
    base = ["trainer.replay_rollouts=runs/old", "trainer.run_dir=runs/new", "trainer.eval_every=0"]
    with pytest.raises(ConfigError, match=f"^{key}: "):
        load_run_config(None, base + override.split())
    assert load_run_config(None, base).trainer.replay_rollouts == "runs/old"


def test_a_missing_saved_rollout_names_the_file(tmp_path):
    from ragen_mega.rollout.replay import ReplayedRollouts

    with pytest.raises(FileNotFoundError, match=r"step_4\.rollout\.pt does not exist .*"
                                                r"trainer\.save_rollouts=true"):
        ReplayedRollouts(tmp_path, tmp_path / "faults.jsonl").rollout(4, 3)


def test_the_configuration_page_names_every_key():
    """docs/configuration.md documents every key of every section (its tail is
    tools/config_reference.py's output: rerun it when a key is added)."""
    import dataclasses

    from ragen_mega.config import RunConfig

    page = (pathlib.Path(__file__).parents[1] / "docs" / "configuration.md").read_text()

    def keys(path, section):   # every key, those of nested sections (actor.lora.rank) too
        for field in dataclasses.fields(section):
            child = getattr(section, field.name)
            yield f"{path}.{field.name}"
            if dataclasses.is_dataclass(child):
                yield from keys(f"{path}.{field.name}", child)

    run = RunConfig()
    missing = [key for section in dataclasses.fields(RunConfig)
               for key in keys(section.name, getattr(run, section.name))
               if f"`{key}`" not in page]
    assert not missing, f"not in docs/configuration.md (run tools/config_reference.py): {missing}"


def _choice_fields(section, prefix=""):
    """(dotted key, choices) of every Literal field of the run config tree (a list of Literals
    too), walked from the dataclasses themselves, so a choice field added later is covered."""
    import dataclasses
    from typing import Literal, get_args, get_origin, get_type_hints

    hints = get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value, tp = getattr(section, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            yield from _choice_fields(value, f"{prefix}{f.name}.")
            continue
        for candidate in (tp, *get_args(tp)):
            if get_origin(candidate) is Literal:
                yield f"{prefix}{f.name}", get_args(candidate)


YAML11_WORDS = {"y", "yes", "n", "no", "on", "off"}
WORD_CHOICES = [(key, choice) for key, choices in _choice_fields(load_run_config())
                for choice in choices if str(choice).lower() in YAML11_WORDS]


def test_choice_fields_with_yaml11_words_exist():
    """The walk finds the documented default ``trainer.async_mode: off`` (else the test below
    would pass on an empty list)."""
    assert ("trainer.async_mode", "off") in WORD_CHOICES
    assert ("trainer.pack_trajectories", "off") in WORD_CHOICES


@pytest.mark.parametrize("key, choice", WORD_CHOICES)
def test_yaml11_boolean_words_are_choices_in_files_and_overrides(tmp_path, key, choice):
    """``off``, ``on``, ``yes``, ``no`` read as the text they are (YAML 1.2's core schema), in a
    config file and in a ``key=value`` override alike, in the spellings YAML 1.1 accepts."""
    *sections, leaf = key.split(".")
    for spelling in {choice, choice.capitalize(), choice.upper()}:
        nested = f"{leaf}: {spelling}"
        for section in reversed(sections):
            nested = f"{section}:\n" + "\n".join("  " + line for line in nested.splitlines())
        path = tmp_path / "c.yaml"
        path.write_text(nested + "\n")
        if spelling != choice:  # another spelling of the word is refused as text, not as False
            with pytest.raises(ConfigError, match=f"{key}: {spelling!r} is not allowed"):
                load_run_config(path)
            continue
        from_file = load_run_config(path)
        from_override = load_run_config(None, [f"{key}={spelling}"])
        for cfg in (from_file, from_override):
            value = cfg
            for part in key.split("."):
                value = getattr(value, part)
            assert value == choice


def test_bool_fields_take_true_false_and_name_the_yaml12_rule():
    cfg = load_run_config(None, ["trainer.colocate=true", "trainer.save_trajectories=False"])
    assert cfg.trainer.colocate is True and cfg.trainer.save_trajectories is False
    with pytest.raises(ConfigError, match=r"trainer.colocate: expected true or false, got 'yes' "
                                          r"\(YAML 1.2"):
        load_run_config(None, ["trainer.colocate=yes"])


@pytest.mark.parametrize("mode", ["one_step_off", "fully"])
def test_async_modes_turn_truncated_is_on_at_slimes_cap_unless_set(mode):
    """slime's cap (2, its --use-tis default) when actor.tis_cap is left unset; a value set is
    kept; a synchronous run leaves it off."""
    assert load_run_config(None, [f"trainer.async_mode={mode}"]).actor.tis_cap == 2.0
    assert load_run_config(None, [f"trainer.async_mode={mode}",
                                  "actor.tis_cap=1.5"]).actor.tis_cap == 1.5
    assert load_run_config(None, []).actor.tis_cap is None
