"""The ``actor`` and ``critic`` sections of the run config: what the Megatron trainer is given
for each model it trains (parallel layout, optimizer, LR schedule, loss aggregation; the
actor's policy loss, the critic's value loss). The run's tree is ``ragen_mega/config.py``."""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from ragen_mega.algo.losses import AggMode, KlKind
from ragen_mega.config_tree import ConfigError, bounded, check_declared, setting
from ragen_mega.models.hf_config import LocalAttention

#: the HF linears (PEFT target_modules names) that LoRA adapters can wrap
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "lm_head")
LrDecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root"]


@dataclasses.dataclass
class LoraConfig:
    """The ``actor.lora`` / ``critic.lora`` sections: PEFT-style low-rank adapters on the
    model's linears (``backends/megatron/lora.py``). With a rank, only the adapters (and a
    critic's value head) get gradients, Adam state and checkpoints; the base weights stay
    ``model.path``'s."""
    rank: int = bounded(0, ge=0, note="0: no adapters, every weight trained", help=(
        "the adapters' rank (PEFT's r)"))
    alpha: float = bounded(16.0, gt=0, help=(
        "the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)"))
    dropout: float = bounded(0.0, ge=0, lt=1, help=(
        "dropout on the adapters' input, in training passes only"))
    target_modules: list[str] = setting(
        default_factory=lambda: list(LORA_TARGETS[:7]), choices=LORA_TARGETS, help=(
            "HF module names (PEFT's target_modules); Megatron's fused qkv and gate/up linears "
            "carry one adapter pair per HF module, as PEFT does. Default: every linear of every "
            "layer; `lm_head` (an untied head only) may be added"))
    sync: Literal["adapters", "merged", "native"] = setting("adapters", help=(
        "what a weight sync sends the engines: `adapters` (the engines' plugin merges them into "
        "the base weights it kept: backends/sglang/lora_merge.py), `merged` (every adapted weight "
        "whole, as a full-weight run sends: for engines started without that plugin), or `native` "
        "(SGLang serves the base and the adapters by name, each version loaded from a PEFT "
        "directory under the run directory: backends/sglang/lora_serving.py). The actor's only: a "
        "critic is never synced"))

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
    """Megatron settings the ``actor`` and ``critic`` sections share. ``validate`` raises
    :class:`ConfigError` naming the field. The LR horizon, log-prob temperature and seed are
    not here: the run derives them (``trainer.total_steps``, for the actor less the critic's
    ``warmup_steps``; ``rollout.temperature``; ``trainer.seed``) and hands them to the trainer."""

    tp: int = bounded(1, ge=1, help="tensor-parallel ranks")
    pp: int = bounded(1, ge=1, help="pipeline stages")
    vpp: int | None = bounded(None, ge=1, help=(
        "virtual pipeline chunks per rank (interleaved 1F1B)"))
    ep: int = bounded(1, ge=1, help=(
        "expert parallel: a mixture of experts' experts split over this many of the data-parallel "
        "ranks (a divisor of trainer.data_parallel and of the expert count)"))
    micro_batch_size: int = bounded(1, ge=1, help="rows (samples) per forward/backward pass")
    ppo_mini_batch_size: int | None = bounded(None, ge=1, help=(
        "episodes per optimizer update (RAGEN/verl count trajectories; an episode's turns stay "
        "together); null = the whole batch, one update per epoch"))
    ppo_epochs: int = bounded(1, ge=1, help=(
        "passes over the batch's mini-batches per training step"))
    max_tokens_per_micro_batch: int | None = bounded(None, ge=1, help=(
        "training micro-batches by a padded-token budget (rows sorted by length) instead of "
        "micro_batch_size rows each; null = fixed count"))
    lr: float = bounded(1e-6, gt=0, help="Adam's learning rate")
    min_lr: float = setting(0.0, help="the learning rate lr_decay_style ends at")
    lr_warmup_steps: int = bounded(0, ge=0, help=(
        "linear LR warm-up: update step k (1-based) uses lr * k / lr_warmup_steps"))
    lr_decay_style: LrDecayStyle = setting("constant", help=(
        "the learning rate's way from lr to min_lr over the run's steps"))
    weight_decay: float = bounded(0.0, ge=0, help=(
        "AdamW's weight decay, never on biases and norm weights (Megatron's rule)"))
    adam_beta1: float = bounded(0.9, ge=0, lt=1, help="Adam's first-moment decay")
    adam_beta2: float = bounded(0.999, ge=0, lt=1, help="Adam's second-moment decay")
    adam_eps: float = bounded(1e-8, gt=0, help="Adam's denominator floor")
    grad_clip: float = bounded(1.0, ge=0, note="0 disables clipping", help=(
        "the gradients are clipped to this global norm"))
    loss_agg_mode: AggMode = setting("token-mean", help=(
        "how the token losses are averaged: over all tokens (token-mean), over each episode's "
        "tokens then over episodes (episode-mean-token-mean), or per row then over rows "
        "(seq-mean-*, verl's; algo/losses.py)"))
    loss_horizon: int | None = bounded(None, ge=1, help=(
        "loss_agg_mode seq-mean-token-sum-norm: the divisor; null: the batch's width - 1"))
    use_distributed_optimizer: bool = setting(False, help=(
        "shard Adam's state over the data-parallel ranks (Megatron's distributed optimizer)"))
    bf16: bool = setting(False, help=(
        "train in bf16 mixed precision, fp32 master weights in Adam (GPUs only: on a CPU it "
        "learned slower, benchmarks/README.md; false: fp32), as every GPU example does"))
    local_attention: LocalAttention = setting("sdpa", help=(
        "without TransformerEngine: `sdpa` = one fused scaled_dot_product_attention call (flash "
        "on GPUs); `unfused` = Megatron's DotProductAttention"))
    moe_aux_loss_coeff: float = bounded(0.0, ge=0, note="0: no load-balancing loss", help=(
        "mixtures of experts: the weight of megatron-core's load-balancing loss (summed over the "
        "MoE layers, averaged over micro-batches, added to the model's loss); 0 = none, the "
        "router learns from the RL loss alone (transformers' Qwen3-MoE trains with 0.001 / top-k "
        "in Megatron's scale: Megatron divides by top-k where transformers does not)"))
    moe_load_balancing: Literal["aux_loss", "seq_aux_loss", "global_aux_loss"] = setting(
        "aux_loss", help=(
            "which load-balancing loss: `aux_loss` (over each micro-batch's tokens, Switch "
            "Transformer's), `seq_aux_loss` (per sequence), `global_aux_loss` (over the global "
            "batch)"))
    moe_grouped_gemm: bool = setting(False, help=(
        "mixtures of experts: each layer's local experts as one grouped GEMM (TransformerEngine's "
        "TEGroupedMLP: needs TE on a GPU) instead of one linear per expert (SequentialMLP, which "
        "runs anywhere). Same weights and mapping either way; the optimizer state of a checkpoint "
        "belongs to the layout it was saved with"))
    lora: LoraConfig = setting(default_factory=LoraConfig, help=(
        "low-rank adapters (LoRA, PEFT's way) on this model's linears: the keys below; rank 0 "
        "(the default) trains every weight"))

    def validate(self):
        """Checks the declared bounds and choices too: the trainer validates a section it is
        handed directly, outside any config tree."""
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
    #: renamed keys, old -> new; critic-only steps are ``critic.warmup_steps``
    RENAMED_KEYS = {"warmup_steps": "lr_warmup_steps"}
    clip_ratio_low: float = bounded(0.2, ge=0, lt=1, help="PPO clip below 1 (StarPO-S: 0.2)")
    clip_ratio_high: float = bounded(0.28, ge=0, help="PPO clip above 1 (StarPO-S: 0.28)")
    clip_ratio_c: float | None = bounded(3.0, gt=1, note="or null to disable dual-clip", help=(
        "dual-clip bound for negative advantages; null = off"))
    entropy_coeff: float = bounded(0.0, ge=0, help="weight of the entropy bonus (0: none)")
    kl_coef: float = bounded(
        0.0, ge=0, note="0 disables the KL term and the reference model", help=(
            "weight of the KL-to-reference loss term (actor.kl_kind)"))
    kl_kind: KlKind = setting("low_var_kl", help=(
        "the estimator of the KL loss and of algo.kl_in_reward (verl's names)"))
    tis_cap: float | None = bounded(None, gt=0, note="slime uses 2", help=(
        "truncated importance sampling: each token's PPO loss is weighted by min(exp(old - engine "
        "log-prob), tis_cap), the engine's sampled log-probs taken as the behaviour policy "
        "(verl's tis_imp_ratio_cap, slime's --use-tis; slime caps at 2). null: off, except with "
        "trainer.async_mode one_step_off or fully, whose samples come from older weights: there "
        "null means slime's 2."))
    routing_replay: bool = setting(False, help=(
        "mixtures of experts: train every token through the experts the engine routed it to "
        "(slime's --use-rollout-routing-replay), so the trainer's log-probs are those of the "
        "routing the engine sampled with. Whether or not it is on, actor/routing_mismatch logs "
        "the share of (token, layer) routings where the two disagree."))
    load: Optional[str] = setting(None, help=(
        "a Megatron torch_dist checkpoint directory (`ragen-mega convert hf-to-megatron`'s "
        "output, or a run's `checkpoints/actor/step_N`) whose weights a fresh run starts from, at "
        "any TP/PP layout (slime's --load); the optimizer starts afresh. model.path still names "
        "the HF directory for the config, tokenizer and engines' first weights (the engines get "
        "the loaded ones before the first rollout; the KL reference is them too). A run with a "
        "checkpoint of its own (trainer.resume) resumes that instead"))

    def validate(self):
        super().validate()
        if self.load is not None and self.lora.rank:
            raise ConfigError("load: full weights to start from, but with lora.rank the "
                              "engines keep model.path's base weights; export the checkpoint "
                              "(ragen-mega convert megatron-to-hf) and give it as model.path")
        return self


@dataclasses.dataclass
class CriticConfig(ModelTrainingConfig):
    """The ``critic`` section: its training settings and the clipped value loss.
    ``warmup_steps`` (verl's ``trainer.critic_warmup``) and ``highlight_first`` are Verlog's
    options; the warm-up lets the policy start moving against a critic that already tracks its
    returns (docs/configuration.md, "Critic options")."""
    enable: bool = setting(True, help=(
        "train a critic (value model); false: critic-free, for algo.adv_estimator grpo or gigpo"))
    lr: float = bounded(1e-5, gt=0, help="the critic's Adam learning rate")
    value_clip: float | None = bounded(0.5, gt=0, note="or null: plain MSE", help=(
        "the value loss is clipped to this range around the old values"))
    warmup_steps: int = bounded(
        0, ge=0, note="critic-only steps; the LR warm-up is lr_warmup_steps", help=(
            "the first this many training steps update the critic only, the actor waits (verl's "
            "trainer.critic_warmup)"))
    highlight_first: float = bounded(1.0, ge=1.0, note="1.0 weighs every token alike", help=(
        "the value loss at each turn's first response token, where the turn-level GAE reads the "
        "turn's value, counts this many times (Verlog's option)"))
