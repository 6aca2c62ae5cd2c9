"""One rank of the Megatron actor or critic: StarPO policy step, critic step, log-probs, values.

Every rank of the TP x PP x DP world calls the same methods in step (``init_parallel`` first).
The trainer takes its settings (any object with the fields it reads and a ``validate()``: the
app's ``actor`` or ``critic`` section; the backend imports nothing of the app), the objective
it minimises (``algo/objectives.py``, called per micro-batch), and what the run derives: the LR
horizon, the sampling temperature its log-probs are taken at, and the seed.

Batches are plain dicts of [B, S] tensors for THIS data-parallel rank (``dp_shard`` cuts them;
``train`` alone takes the global batch and shards it itself): ``input_ids`` (prompt +
response, right padded), ``loss_mask`` (1 on model-written tokens), optional ``attention_mask``
(right padding; lets micro-batches be trimmed), and per-token values ALIGNED WITH
``input_ids``: column t belongs to token t (computed from tokens < t), column 0 unused:
``old_logprobs``, ``advantages``, ``ref_logprobs`` (actor), ``returns``, ``old_values``
(critic). That is a rollout record's layout, and ``compute_logprobs`` / ``compute_values``
return it too.

Loss normalisation is ``algo.losses``'s (module doc): each micro-batch loss is its share of the
DP-global mean times M * D (Megatron's schedule divides by the M micro-batches, DDP averages over
the D replicas), so the gradient is the whole (mini-)batch's whatever the split.

A training step advances the LR schedule and ``steps`` once, however many updates it makes (as
verl's LR schedule counts training steps), so checkpoints stay named by the run's step. An update
whose loss or gradients hold a NaN or inf on any rank is skipped on every rank (one all-reduced
flag) and counted (docs/design.md, "Faults that cost an episode or an update, not the run").
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from ragen_mega.algo.losses import loss_normalizer
from ragen_mega.algo.objectives import OBJECTIVES, Normalization
from ragen_mega.backends.megatron import checkpoint as ckpt
from ragen_mega.backends.megatron.cpu_compat import cuda_tensor_type_names
from ragen_mega.backends.megatron.forward import (forward_logprobs, forward_values,
                                                  make_forward_step, run_schedule,
                                                  split_microbatches)
from ragen_mega.backends.megatron.chunk import unwrap
from ragen_mega.backends.megatron.export import DirectExport, export_hf_state
from ragen_mega.backends.megatron.lora import LoraSettings, adapters_off, apply_lora
from ragen_mega.backends.megatron.lora_export import AdapterExport
from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint
from ragen_mega.backends.megatron.parallel import local_device
from ragen_mega.backends.megatron.routing import take_mismatch_counts
from ragen_mega.models.hf_config import model_spec

def _dp_group():
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_group()


def dp_shard(batch: dict) -> dict:
    """This data-parallel rank's contiguous rows of a global batch (B divisible by DP)."""
    from megatron.core import parallel_state as mpu

    dp, rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    rows = batch["input_ids"].shape[0]
    if rows % dp:
        raise ValueError(f"dp_shard: batch of {rows} rows does not split over {dp} DP ranks")
    per = rows // dp
    return {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}


def pad_rows(batch: dict, multiple: int) -> dict:
    """``batch`` padded to a multiple of ``multiple`` rows (the DP ranks) with copies of its
    first row whose ``loss_mask`` is zero: they add nothing to any loss or normaliser. Per-turn
    rows (unpacked episodes) vary in number from step to step."""
    rows = batch["input_ids"].shape[0]
    extra = -rows % multiple
    if not extra:
        return batch
    padded = {k: torch.cat([v, v[:1].expand(extra, *v.shape[1:])]) for k, v in batch.items()}
    if "loss_mask" in padded:
        padded["loss_mask"][rows:] = 0
    return padded


def ppo_minibatches(batch: dict, episodes: int | None) -> list[dict]:
    """A global batch cut into PPO mini-batches of ``episodes`` whole episodes each (RAGEN /
    verl count ``ppo_mini_batch_size`` in trajectories), in order of first appearance, rows in
    batch order. ``None``: the whole batch is one mini-batch."""
    if episodes is None:
        return [batch]
    if "episode_id" not in batch:
        raise KeyError("ppo_mini_batch_size counts episodes: the batch needs episode_id "
                       f"(has {sorted(batch)})")
    ids = batch["episode_id"].tolist()
    chunk_of = {e: i // episodes for i, e in enumerate(dict.fromkeys(ids))}
    chunk = torch.tensor([chunk_of[e] for e in ids])
    return [{k: v[chunk == c] for k, v in batch.items()}
            for c in range(max(chunk_of.values()) + 1)]


def _to_device(batch: dict) -> dict:
    return {k: v.to(local_device(), non_blocking=True) for k, v in batch.items()}


def _shifted(t: torch.Tensor) -> torch.Tensor:
    """Token-aligned [B, S] -> next-token layout [B, S-1] of forward.py (drop column 0)."""
    return t[:, 1:].float()


def _unshifted(t: torch.Tensor) -> torch.Tensor:
    """[B, S-1] next-token layout -> token-aligned [B, S] with a zero column 0."""
    return torch.cat([t.new_zeros(t.shape[0], 1), t], dim=1)


def _check_batch(batch: dict, keys: tuple[str, ...], fn: str) -> None:
    missing = [k for k in ("input_ids", "loss_mask", *keys) if k not in batch]
    if missing:
        raise KeyError(f"{fn}: batch lacks {missing} (has {sorted(batch)})")
    shape = tuple(batch["input_ids"].shape)
    if len(shape) != 2 or shape[1] < 2:
        raise ValueError(f"{fn}: input_ids must be [batch, seq>=2], got {shape}")
    for k in ("loss_mask", "attention_mask", *keys):
        if k in batch and tuple(batch[k].shape) != shape:
            raise ValueError(f"{fn}: batch[{k!r}] has shape {tuple(batch[k].shape)}, "
                             f"input_ids has {shape} (per-token values are aligned with tokens)")


class MegatronTrainer:
    """Model chunks in Megatron DDP, Megatron's (distributed) Adam, LR schedule, grad clipping."""

    def __init__(self, config, hf_dir, role: str = "actor", *,
                 total_steps: int = 1000, temperature: float = 1.0, seed: int = 1234,
                 objective=None):
        """``total_steps``: the LR schedule's decay horizon (min_lr afterwards); ``temperature``:
        log-probs and entropy are those of the sampling distribution at this temperature;
        ``objective``: the loss ``train`` minimises (``algo/objectives.py``; default: the
        role's, built from ``config``)."""
        from megatron.core import parallel_state as mpu
        from megatron.core import tensor_parallel

        self.config = config.validate()
        for field, actual in (("tp", mpu.get_tensor_model_parallel_world_size()),
                              ("pp", mpu.get_pipeline_model_parallel_world_size()),
                              ("vpp", mpu.get_virtual_pipeline_model_parallel_world_size()),
                              ("ep", mpu.get_expert_model_parallel_world_size())):
            if getattr(config, field) != actual:
                raise ValueError(f"{type(config).__name__}.{field}={getattr(config, field)} but "
                                 f"the process groups were initialised with {field}={actual}")
        if role not in OBJECTIVES:
            raise ValueError(f"MegatronTrainer: role must be 'actor' or 'critic', got {role!r}")
        if total_steps <= config.lr_warmup_steps:
            raise ValueError(f"total_steps: must be > lr_warmup_steps={config.lr_warmup_steps} "
                             f"(got {total_steps})")
        if not temperature > 0:
            raise ValueError(f"temperature: must be > 0 (got {temperature})")
        self.total_steps, self.temperature = total_steps, temperature
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        self.role, self.hf_dir, self.steps = role, hf_dir, 0
        # the actor's MoE routers take the engine's experts (ActorConfig.routing_replay)
        self.routing_replay = bool(getattr(config, "routing_replay", False))
        self.skipped_in_row = 0
        self.objective = objective if objective is not None else OBJECTIVES[role](config)
        self.dtype = torch.bfloat16 if config.bf16 else torch.float32
        lora_config = getattr(config, "lora", None)
        self.lora = lora_config.validate().settings() if lora_config is not None else None
        self.model = self._wrap_ddp(self._load(role, self.lora, seed))
        self.optimizer, self.scheduler = self._build_optimizer()
        self.ref_model = None
        if self.objective.needs_reference and self.lora is None:  # LoRA's is its frozen base
            self.ref_model = self._load("actor")
            for chunk in self.ref_model:
                chunk.requires_grad_(False)
                chunk.eval()

    # ------------------------------------------------------------------ construction
    def _load(self, role: str, lora: LoraSettings | None = None, seed: int = 0) -> list:
        """The role's model chunks with the start weights (the HF directory's, or an actor's
        ``load`` checkpoint's, which the KL reference starts from too) and ``lora``'s adapters,
        on the local layer spec: TransformerEngine's fuses the norm into the adapted linears."""
        chunks = build_model(self.hf_dir, role=role, dtype=self.dtype,
                             use_te=False if lora else None,
                             local_attention=self.config.local_attention,
                             config_overrides=self._moe_settings())
        start = getattr(self.config, "load", None)  # an ActorConfig's; a critic has none
        if start is not None:
            ckpt.load_checkpoint(ckpt.find_checkpoint(start), chunks)
        else:
            load_hf_checkpoint(chunks, self.hf_dir)
        if lora is not None:
            apply_lora(chunks, lora, seed)
        return chunks

    def _moe_settings(self) -> dict:
        """An MoE model's configured TransformerConfig settings (load-balancing loss,
        grouped-GEMM experts); nothing for a dense model."""
        c = self.config
        if not model_spec(self.hf_dir).is_moe:
            return {}
        out = {"moe_grouped_gemm": True} if c.moe_grouped_gemm else {}
        if c.moe_aux_loss_coeff:
            out.update(moe_router_load_balancing_type=c.moe_load_balancing,
                       moe_aux_loss_coeff=c.moe_aux_loss_coeff)
        return out

    def _wrap_ddp(self, chunks: list) -> list:
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig, finalize_model_grads)
        from megatron.core.utils import get_model_config

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=self.config.use_distributed_optimizer)
        model = [DistributedDataParallel(get_model_config(c), ddp_config, c,
                                         disable_bucketing=i > 0)  # as Megatron-LM does
                 for i, c in enumerate(chunks)]
        # The schedule all-reduces DP grads (and tied-embedding grads across PP stages) here.
        get_model_config(model[0]).finalize_model_grads_func = finalize_model_grads
        return model

    def _build_optimizer(self):
        from megatron.core.optimizer import AdamOptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        c = self.config
        opt_config = AdamOptimizerConfig(
            lr=c.lr, min_lr=c.min_lr, weight_decay=c.weight_decay, adam_beta1=c.adam_beta1,
            adam_beta2=c.adam_beta2, adam_eps=c.adam_eps, clip_grad=c.grad_clip, bf16=c.bf16,
            params_dtype=self.dtype, use_distributed_optimizer=c.use_distributed_optimizer)
        with cuda_tensor_type_names():
            optimizer = get_megatron_optimizer(opt_config, self.model)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if c.lr_warmup_steps else c.lr, max_lr=c.lr, min_lr=c.min_lr,
            lr_warmup_steps=c.lr_warmup_steps, lr_decay_steps=self.total_steps,
            lr_decay_style=c.lr_decay_style, start_wd=c.weight_decay, end_wd=c.weight_decay,
            wd_incr_steps=self.total_steps, wd_incr_style="constant")
        return optimizer, scheduler

    # ------------------------------------------------------------------ inference
    def compute_logprobs(self, batch: dict) -> torch.Tensor:
        """[B, S] log-probs of each token given the tokens before it (column 0 is 0)."""
        return self._logprobs(self.model, batch)

    def compute_ref_logprobs(self, batch: dict) -> torch.Tensor:
        """The reference policy's log-probs: the start weights, kept as a second model, or with
        LoRA the frozen base (adapters off)."""
        if self.lora is not None and self.objective.needs_reference:
            with adapters_off(self.model):
                return self._logprobs(self.model, batch)
        if self.ref_model is None:
            raise RuntimeError("compute_ref_logprobs: no reference model (the objective needs "
                               "none: ActorConfig.kl_coef is 0, or this is a critic)")
        return self._logprobs(self.ref_model, batch)

    def _logprobs(self, chunks, batch):
        if self.role != "actor":
            raise RuntimeError("compute_logprobs needs role='actor'")
        batch = _to_device(batch)
        logprobs, _ = forward_logprobs(chunks, batch["input_ids"], batch.get("attention_mask"),
                                       temperature=self.temperature, compute_entropy=False,
                                       micro_batch_size=self.config.micro_batch_size,
                                       routed_experts=batch.get("routed_experts"),
                                       routing_replay=self.routing_replay)
        return _unshifted(logprobs)

    def compute_values(self, batch: dict) -> torch.Tensor:
        """[B, S] critic values: column t is V(state before token t) (column 0 is 0)."""
        if self.role != "critic":
            raise RuntimeError("compute_values needs role='critic'")
        batch = _to_device(batch)
        values = forward_values(self.model, batch["input_ids"], batch.get("attention_mask"),
                                micro_batch_size=self.config.micro_batch_size)
        return _unshifted(values[:, :-1])

    # ------------------------------------------------------------------ training
    def _microbatches(self, batch: dict, keys: tuple[str, ...]):
        """Micro-batches (per-token tensors in next-token layout), the global loss normaliser,
        the global loss-token count, the batch width (the default loss horizon) and the global
        padding fraction of the micro-batches (padded tokens / all tokens fed)."""
        mbs, budget = self.config.micro_batch_size, self.config.max_tokens_per_micro_batch
        extra = {k: _shifted(batch[k]) for k in ("loss_mask", *keys)}
        if self.role == "actor" and "routed_experts" in batch:  # the engine served the actor
            extra["routed_experts"] = batch["routed_experts"]
        mbs_list = split_microbatches(batch["input_ids"], batch.get("attention_mask"), mbs,
                                      max_tokens=budget, **extra)
        fed = sum(mb["attention_mask"].numel() for mb in mbs_list)  # tokens incl. padding
        counts = torch.stack([t.float() for t in (
            sum(loss_normalizer(mb["loss_mask"], self.config.loss_agg_mode) for mb in mbs_list),
            sum(mb["loss_mask"].sum() for mb in mbs_list),
            sum(mb["attention_mask"].sum() for mb in mbs_list),
            batch["input_ids"].new_tensor(fed))])
        dist.all_reduce(counts, group=_dp_group())
        return (mbs_list, counts[0], counts[1].clamp(min=1), batch["input_ids"].shape[1] - 1,
                float(1 - counts[2] / counts[3]))

    def train(self, batch: dict) -> dict:
        """One training step on the GLOBAL batch (the same dict on every rank): ``ppo_epochs``
        passes over its PPO mini-batches (:func:`ppo_minibatches`), one optimizer update each on
        this DP rank's rows. ``old_logprobs`` / ``old_values`` stay the rollout policy's, so the
        PPO clip acts from the second update on. Metrics, the same on every rank, are the mean
        over the updates, under verl's names where verl has the quantity (docs/metrics.md,
        ``actor/`` and ``critic/``)."""
        c = self.config
        from megatron.core import parallel_state as mpu

        dp = mpu.get_data_parallel_world_size()
        minibatches = [pad_rows(mb, dp) for mb in ppo_minibatches(batch, c.ppo_mini_batch_size)]
        self.scheduler.step(1)  # once a step; lr of this step: schedule at step k (1-based)
        results = [self._update(dp_shard(mb)) for _ in range(c.ppo_epochs) for mb in minibatches]
        if any(r["update_successful"] for r in results):
            self.steps += 1
        for r in results:
            self.skipped_in_row = 0 if r["update_successful"] else self.skipped_in_row + 1
        metrics = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
        metrics.update(ppo_updates=float(len(results)),
                       updates_skipped=float(sum(not r["update_successful"] for r in results)),
                       updates_skipped_in_row=float(self.skipped_in_row))
        return metrics

    def _all_finite(self, results: list) -> bool:
        """Whether the loss statistics and every gradient are finite on EVERY rank (a MAX
        all-reduce of one flag over TP, PP and DP)."""
        bad = torch.zeros((), device=local_device())
        for r in results:  # last pipeline stage only
            bad = torch.maximum(bad, (~torch.isfinite(r["stats"])).any().float())
        for chunk in self.model:
            for p in chunk.parameters():
                grad = getattr(p, "main_grad", None)
                if grad is not None:
                    bad = torch.maximum(bad, (~torch.isfinite(grad)).any().float())
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad)

    def _step(self, microbatches: list, loss_fn, objective) -> dict:
        """Forward/backward over all micro-batches, optimizer update; global metrics on every
        rank (``objective``'s statistics, summed, then summarized)."""
        from megatron.core import parallel_state as mpu

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        results = run_schedule(self.model, microbatches,
                               make_forward_step(temperature=self.temperature, loss_fn=loss_fn,
                                                 routing_replay=self.routing_replay),
                               forward_only=False)
        lr = self.optimizer.param_groups[0]["lr"]
        updated, grad_norm = False, None
        if self._all_finite(results):  # else skipped: weights and Adam state untouched
            with cuda_tensor_type_names():
                updated, grad_norm, _ = self.optimizer.step()
        stats = torch.zeros(len(objective.stat_names), device=local_device())
        for r in results:  # last pipeline stage only; summed shares of the global means
            stats += r["stats"]
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(stats, group=mpu.get_pipeline_model_parallel_group())
        dist.all_reduce(stats, group=_dp_group())
        metrics = objective.summarize(dict(zip(objective.stat_names, stats.tolist())))
        metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                       lr=float(lr), update_successful=float(bool(updated)))
        return metrics

    def _update(self, batch: dict) -> dict:
        """One optimizer update on this DP rank's rows of one mini-batch, each micro-batch's
        loss scaled to its share of the global mean (module doc)."""
        from megatron.core import parallel_state as mpu

        objective = self.objective
        if objective.needs_reference and "ref_logprobs" not in batch:
            batch = {**batch, "ref_logprobs": self.compute_ref_logprobs(batch)}
        _check_batch(batch, objective.keys, "train")
        batch = _to_device(objective.prepare(batch))
        microbatches, normalizer, global_tokens, width, padding = self._microbatches(
            batch, objective.keys)
        # undo the schedule's 1/M and DDP's 1/D: the gradients are those of the global loss
        scale = float(len(microbatches) * mpu.get_data_parallel_world_size())
        norm = Normalization(self.config.loss_agg_mode, normalizer,
                             self.config.loss_horizon or width, global_tokens)

        def loss_fn(outputs, mb):
            loss, stats = objective(outputs, mb, norm)
            return loss * scale, {"stats": stats}

        take_mismatch_counts(self.model)  # counted from here: this update's forward only
        metrics = {**self._step(microbatches, loss_fn, objective),
                   "padding_frac": padding}
        return {**metrics, **self._routing_mismatch()}

    def _routing_mismatch(self) -> dict:
        """``routing_mismatch``: the share of (token, MoE layer) pairs of the update's forward
        whose own top-k experts differ from the engine's (``routing.py``), over every rank;
        nothing for a dense model or a batch without the engine's experts."""
        if not unwrap(self.model[0]).ragen_spec.is_moe:
            return {}
        counts = take_mismatch_counts(self.model).to(local_device())
        dist.all_reduce(counts)  # DP ranks hold other tokens, PP stages other layers
        return {"routing_mismatch": float(counts[0] / counts[1])} if counts[1] else {}

    # ------------------------------------------------------------------ state
    def save_checkpoint(self, root, step: int, extra: dict | None = None):
        """Atomic ``<root>/step_<step>`` with model, optimizer, LR schedule and ``extra``; the
        caller's step names it (a run's loop step, so actor and critic agree)."""
        return ckpt.save_checkpoint(root, step, self.model, self.optimizer, self.scheduler,
                                    extra=extra, hf_dir=self.hf_dir)

    def load_checkpoint(self, path, optimizer: bool = True) -> dict:
        """Load a checkpoint dir (or the newest under a root); returns its ``extra`` dict.

        ``optimizer=False`` loads weights only (e.g. a converted HF checkpoint) and keeps the
        step count at 0."""
        found = ckpt.find_checkpoint(path)
        loaded = ckpt.load_checkpoint(found, self.model, self.optimizer if optimizer else None,
                                      self.scheduler if optimizer else None)
        if optimizer:
            self.steps = loaded.step
        return loaded.extra

    def export_hf_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole model as (HF name, full tensor), on every rank (collective)."""
        return export_hf_state(self.model)

    def weight_export(self, dst: int, prefetch_bytes: int) -> DirectExport | AdapterExport:
        """The weight-sync export to global rank ``dst`` (collective: every rank iterates it to
        the end). With ``lora.sync: adapters`` the adapters alone (:class:`AdapterExport`), else
        the (merged) weights whole (:class:`DirectExport`)."""
        if self.lora is not None and self.config.lora.sync == "adapters":
            return AdapterExport(self.model, dst=dst)
        return DirectExport(self.model, dst=dst, prefetch_bytes=prefetch_bytes)
