"""The ``actor`` and ``critic`` sections of the run config: what the Megatron trainer is given
for each model it trains (parallel layout, optimizer, LR schedule, loss aggregation; the
actor's policy loss, the critic's value loss). The run's tree is ``ragen_mega/config.py``."""
from __future__ import annotations

import dataclasses
from typing import Literal

from ragen_mega.algo.losses import AggMode, KlKind
from ragen_mega.config_tree import ConfigError, bounded, check_declared
from ragen_mega.models.hf_config import LocalAttention

#: the HF linears (PEFT target_modules names) that LoRA adapters can wrap
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "lm_head")
LrDecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root"]


@dataclasses.dataclass
class LoraConfig:
    """The ``actor.lora`` / ``critic.lora`` sections: low-rank adapters on the model's linears,
    PEFT's settings (``backends/megatron/lora.py``). ``rank: 0`` trains every weight. With a
    rank, only the adapters (and a critic's value head) get gradients and Adam state,
    checkpoints hold those, and the base weights stay those of ``model.path``. ``sync`` is the
    actor's (the critic is never synced)."""
    rank: int = bounded(0, ge=0, note="0: no adapters, every weight trained")  # PEFT's r
    alpha: float = bounded(16.0, gt=0)     # the adapters' output is scaled by alpha / rank
    dropout: float = bounded(0.0, ge=0, lt=1)  # on the adapters' input, in training passes only
    #: HF module names (PEFT's target_modules); Megatron's fused qkv and gate/up linears carry
    #: one adapter pair per HF module, as PEFT does. Default: every linear of every layer;
    #: ``lm_head`` (an untied head only) may be added
    target_modules: list[str] = dataclasses.field(default_factory=lambda: list(LORA_TARGETS[:7]))
    #: what a weight sync sends the engines: "adapters" (the engines' plugin merges them into
    #: the base weights it kept: backends/sglang/lora_merge.py), "merged" (every adapted
    #: weight whole, as a full-weight run sends: for engines started without that plugin), or
    #: "native" (SGLang serves the base and the adapters by name, each version loaded from a
    #: PEFT directory under the run directory: backends/sglang/lora_serving.py)
    sync: Literal["adapters", "merged", "native"] = "adapters"

    def validate(self):
        check_declared(self)
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown:
            raise ConfigError(f"target_modules: {unknown} are not among the linears adapters "
                              f"can wrap {list(LORA_TARGETS)}")
        if self.rank and not self.target_modules:
            raise ConfigError("target_modules: empty; name at least one linear or set rank: 0")
        return self

    def settings(self):
        """The trainer's ``LoraSettings``; None for ``rank: 0``."""
        if not self.rank:
            return None
        from ragen_mega.backends.megatron.lora import LoraSettings

        return LoraSettings(self.rank, self.alpha, self.dropout, tuple(self.target_modules))


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
    #: low-rank adapters (the critic's value head is trained whole beside them)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)

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
    #: trainer.async_mode needs it: its samples come from older weights.
    tis_cap: float | None = bounded(None, gt=0, note="slime uses 2; None turns it off")
    #: mixtures of experts: train every token through the experts the engine routed it to
    #: (slime's --use-rollout-routing-replay), so the trainer's log-probs are those of the
    #: routing the engine sampled with. Whether or not it is on, actor/routing_mismatch logs
    #: the share of (token, layer) routings where the two disagree.
    routing_replay: bool = False


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
