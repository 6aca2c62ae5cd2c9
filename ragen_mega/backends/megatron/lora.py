"""LoRA adapters on megatron-core's tensor-parallel linears: only the adapters train.

``apply_lora(chunks, settings, seed)`` hangs a :class:`LoraLinear` (``.lora``) on each targeted
linear of a chunk whose base weights are loaded, with a forward hook that adds
``s * B(A(dropout(x)))`` to the output (``s = alpha / rank``, PEFT's scaling), and freezes every
other parameter, so DDP keeps gradient buffers and Adam state for the adapters alone.

Targets are PEFT's HF module names (``q_proj`` ... ``down_proj``), one pair (A, B) per HF module
inside Megatron's fused ``linear_qkv`` and ``linear_fc1``: ``Rule.hf_to_shard``, fed each
module's row indices, returns the shard's rows in Megatron order, so the adapters follow the
grouped-KV qkv layout and the ``[gate_r; up_r]`` halves.

TP splits are Megatron's for a low-rank pair. Column-parallel (qkv, fc1): A [r, in] whole, B by
output rows; ``h = A x`` passes ``copy_to_tensor_model_parallel_region`` (identity forward,
all-reduce backward), so A's gradient is whole on every rank. Row-parallel (o_proj, fc2): A by
input columns, B [out, r] whole; the partial ``A_r x_r`` are all-reduced before B (r values a
token rather than the output's hidden). Under sequence parallelism (MoE at TP > 1) ``A x`` is
gathered over the tokens and ``A_r x_r`` reduce-scattered, as the linear does with x and its
output; an expert's linears need no collective (the token dispatcher gives every TP rank of an
expert all its tokens and sums fc2's partial outputs). In both, each rank sees only part of the
whole matrices' gradients (column-parallel A, row-parallel B), so they too are read through
``copy_to_tensor_model_parallel_region``, which sums them over the ranks. The sharded matrices
carry megatron-core's TP attributes, so the gradient norm counts every rank's slice and a
replica once. Pipeline stages hold their own layers' adapters; DP and the distributed optimizer
see ordinary trainable parameters.

Mixtures of experts: each expert's ``linear_fc1`` / ``linear_fc2`` takes HF's per-expert
``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` adapters (the keys PEFT reads onto
transformers' fused experts, and SGLang's per-expert names); the shared expert's are a dense
MLP's. An expert-parallel rank holds its own experts' adapters, marked ``allreduce = False``
(megatron-core's expert mark), so gradients are reduced over the expert-data-parallel ranks only.

Initialisation is PEFT's (A uniform in +-1/sqrt(in), B zero), drawn whole per HF module seeded
by the run's seed and the module's name, then sliced: every layout starts from the same adapters.

The merged weight ``W = W_base + s * B A`` (:func:`merged_weights`), what an export or full
weight sync sends, is computed afresh from the frozen base in fp32, so nothing drifts.
Checkpoints hold the adapters only (:func:`sharded_state_dict`) under their HF names and whole
shapes, so they reshard across TP x PP. ``lora_export.py`` takes the adapters out whole.

Not supported: TransformerEngine's layer spec (its linears take the norm's input).
(docs/design.md, "LoRA")
"""
from __future__ import annotations

import contextlib
import dataclasses
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from ragen_mega.models import mapping
from ragen_mega.models.hf_config import ModelSpec


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """What the trainer needs of ``actor.lora`` (the config section validates it)."""
    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def signature(self) -> dict:
        """What a checkpoint's adapters must agree on to load (dropout may change)."""
        return {"rank": self.rank, "alpha": float(self.alpha),
                "target_modules": sorted(self.target_modules)}


def check_supported(spec: ModelSpec, settings: LoraSettings, role: str = "actor") -> None:
    if role == "critic" and "lm_head" in settings.target_modules:
        raise ValueError("lora.target_modules: a critic has no lm_head (its head is the value "
                         "head, trained whole); leave it out")
    if "lm_head" in settings.target_modules and spec.tie_word_embeddings:
        raise ValueError("lora.target_modules: lm_head of a model with tied embeddings (the "
                         "head is the input embedding, which adapters do not wrap); leave it out")


def _module_name(hf_weight_name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``model.layers.3.self_attn.q_proj``."""
    return hf_weight_name[: -len(".weight")]


def _short(hf_weight_name: str) -> str:
    return _module_name(hf_weight_name).rsplit(".", 1)[-1]


def _init_a(name: str, rank: int, fan_in: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    bound = 1.0 / fan_in ** 0.5   # kaiming_uniform(a=sqrt(5)), PEFT's init of lora_A
    return (torch.rand(rank, fan_in, generator=gen, dtype=torch.float64) * 2 - 1) * bound


class LoraLinear(nn.Module):
    """The adapters of one Megatron linear (global name ``weight_name``), this TP rank's part.

    ``A[p]`` / ``B[p]`` per targeted HF module ``p`` (short name: ``q_proj``); ``hf_names[p]``
    its full HF name; ``rows[p]`` (column-parallel) this rank's slice of its HF output rows,
    ``cols`` (row-parallel) of HF input columns; ``order`` maps the shard's output rows
    (Megatron order) to the concatenated per-module outputs, untargeted rows (and vocabulary
    padding) to a trailing zero.

    The LM head's B [vocab, r] is whole on every rank (its TP shards would be uneven where the
    vocabulary is padded); each rank reads its rows through
    ``copy_to_tensor_model_parallel_region``, so B's gradient is summed over the ranks."""

    def __init__(self, weight_name: str, spec: ModelSpec, settings: LoraSettings,
                 tp_rank: int, tp: int, seed: int, dtype: torch.dtype, device,
                 comm: str | None = None, group=None):
        super().__init__()
        # how the linear's TP ranks meet (None at TP 1; see delta): "tensor" (plain TP),
        # "sequence" (sequence parallelism), "expert" (the token dispatcher's), over ``group``
        self.comm, self.group = comm, group
        rule = mapping.rule_of(weight_name, spec)   # the layers' rules are the actor's
        hf = list(rule.hf_names(weight_name))
        shapes = [mapping.hf_shape(n, spec) for n in hf]
        self.column, self.whole_b, self.enabled = rule.tp_dim == 0, rule.vocab, True
        self.expert = rule.expert is not None   # a routed expert's linear
        self.settings = settings
        self.hf_names = {_short(n): _module_name(n) for n in hf
                         if _short(n) in settings.target_modules}
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        self.rows: dict[str, slice] = {}
        r = settings.rank
        if self.column:
            starts = [sum(s[0] for s in shapes[:i]) for i in range(len(shapes))]
            # 1-based, so the vocabulary's padding rows (zeros) read as -1: no module's
            index = [torch.arange(st, st + s[0]).unsqueeze(1) + 1 for st, s in zip(starts, shapes)]
            held = rule.hf_to_shard(index, spec, tp_rank, tp)[:, 0] - 1
            taken, offset = {}, 0
            for n, st, s in zip(hf, starts, shapes):
                mine = held[(held >= st) & (held < st + s[0])] - st
                short = _short(n)
                if short not in self.hf_names:
                    continue
                lo, hi = int(mine.min()), int(mine.max()) + 1
                if hi - lo != len(mine):
                    raise AssertionError(f"{n}: rows of TP rank {tp_rank} are not contiguous")
                self.rows[short] = slice(lo, hi)
                taken.update({st + lo + j: offset + j for j in range(hi - lo)})
                offset += hi - lo
                a = _init_a(self.hf_names[short], r, s[1], seed)
                self.A[short] = nn.Parameter(a.to(dtype=dtype, device=device))
                rows = s[0] if self.whole_b else hi - lo
                self.B[short] = nn.Parameter(torch.zeros(rows, r, dtype=dtype, device=device))
            self.register_buffer("order", torch.tensor([taken.get(int(i), offset) for i in held],
                                                       device=device), persistent=False)
        else:
            (n,), (shape,) = hf, shapes
            index = torch.arange(shape[1]).unsqueeze(0)
            cols = rule.hf_to_shard([index], spec, tp_rank, tp)[0]
            self.cols = slice(int(cols[0]), int(cols[-1]) + 1)
            short = _short(n)
            a = _init_a(self.hf_names[short], r, shape[1], seed)[:, self.cols]
            self.A[short] = nn.Parameter(a.to(dtype=dtype, device=device).contiguous())
            self.B[short] = nn.Parameter(torch.zeros(shape[0], r, dtype=dtype, device=device))

    def tensors(self):
        """(PEFT key, parameter, the TP axis it is this rank's slice along, or None)."""
        for short, hf in self.hf_names.items():
            yield f"{hf}.lora_A.weight", self.A[short], None if self.column else 1
            yield (f"{hf}.lora_B.weight", self.B[short],
                   0 if self.column and not self.whole_b else None)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``s * B A dropout(x)`` in the layout of the linear's output shard."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region)

        p = self.settings.dropout
        if p and self.training and torch.is_grad_enabled():   # training passes only
            x = F.dropout(x, p)
        if not self.column:
            (short,) = self.A
            h = F.linear(x, self.A[short])
            if self.comm == "tensor":
                h = reduce_from_tensor_model_parallel_region(h, self.group)
            elif self.comm == "sequence":   # summed, and cut by tokens as the output is
                h = reduce_scatter_to_sequence_parallel_region(h, self.group)
            # "expert": B A_r x_r is partial like the output, which the dispatcher sums
            return F.linear(h, self._shared(self.B[short])) * self.settings.scaling
        parts = []
        for short in self.A:
            h = F.linear(x, self._shared(self.A[short]))
            if self.comm == "tensor":
                h = copy_to_tensor_model_parallel_region(h, self.group)
            elif self.comm == "sequence":   # this rank's tokens -> all, as the linear gathers x
                h = gather_from_sequence_parallel_region(h, group=self.group)
            parts.append(F.linear(h, self._b(short)))
        parts.append(parts[0].new_zeros(*parts[0].shape[:-1], 1))   # (rows of x: all tokens)
        return torch.cat(parts, dim=-1).index_select(-1, self.order) * self.settings.scaling

    def _shared(self, param: torch.Tensor) -> torch.Tensor:
        """A matrix whole on every rank (column-parallel A, row-parallel B), read through
        ``copy_to_tensor_model_parallel_region`` where each rank's backward gives only part of
        its gradient (sequence parallelism, experts: module docstring), so the parts are summed."""
        if self.comm not in ("sequence", "expert"):
            return param
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        return copy_to_tensor_model_parallel_region(param, self.group)

    def _b(self, short: str) -> torch.Tensor:
        """This rank's rows of ``B[short]`` (all of it but the LM head's)."""
        if not self.whole_b:
            return self.B[short]
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        b = (copy_to_tensor_model_parallel_region(self.B[short], self.group) if self.comm
             else self.B[short])
        return b[self.rows[short]]

    def merged(self, base: torch.Tensor) -> torch.Tensor:
        """``base + s * B A`` for this rank's shard of the weight, computed in fp32."""
        if not self.column:
            (short,) = self.A
            delta = self.B[short].float() @ self.A[short].float()
        else:
            rows = [self._b(s).float() @ self.A[s].float() for s in self.A]
            rows.append(base.new_zeros(1, base.shape[1], dtype=torch.float32))
            delta = torch.cat(rows).index_select(0, self.order)
        return (base.float() + self.settings.scaling * delta).to(base.dtype)


def _hook(module, args, output):
    if not module.lora.enabled:
        return output
    out, bias = output
    return out + module.lora.delta(args[0]), bias


@contextlib.contextmanager
def adapters_off(chunks):
    """The base model inside the block: every adapter's output is left out (the reference
    policy of a KL term, without a second copy of the weights)."""
    from ragen_mega.backends.megatron.chunk import unwrap

    loras = [lora for chunk in chunks for _, lora in adapters(unwrap(chunk))]
    for lora in loras:
        lora.enabled = False
    try:
        yield
    finally:
        for lora in loras:
            lora.enabled = True


def apply_lora(chunks, settings: LoraSettings, seed: int) -> None:
    """Adapters on every targeted linear of ``chunks`` (bare GPTModels or their wrappers, base
    weights loaded), every other parameter frozen. Call before wrapping them in DDP."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from ragen_mega.backends.megatron.chunk import unwrap

    for chunk in chunks:
        model = unwrap(chunk)
        spec, role = model.ragen_spec, model.ragen_role
        check_supported(spec, settings, role)
        model.requires_grad_(False)
        if role == "critic" and model.post_process:   # the value head trains whole
            model.output_layer.requires_grad_(True)
        rules = [r for r in mapping.adaptable_rules(spec, role)
                 if any(_short(n) in settings.target_modules for n in r.hf)]
        experts = model.ragen_experts   # this expert-parallel rank's
        wrapped = [r.megatron.format(i=i) for i in model.ragen_layers
                   for r in rules if r.place == "layer" and r.expert in (None, *experts)]
        if model.post_process:
            wrapped += [r.megatron for r in rules if r.place == "head"]
        for name in wrapped:
            local = mapping.to_local(name, model.ragen_layers.start, experts.start)
            linear = model.get_submodule(local[: -len(".weight")])
            base, group = linear.weight, linear.tp_group   # an expert's: the expert TP group
            tp = group.size()
            comm = (None if tp == 1 else "expert" if linear.explicit_expert_comm
                    else "sequence" if linear.sequence_parallel else "tensor")
            linear.lora = LoraLinear(name, spec, settings, group.rank(), tp, seed, base.dtype,
                                     base.device, comm, group)
            for _, param, axis in linear.lora.tensors():
                # megatron-core's marks: a TP slice's norm counts on every rank, a replica's
                # once; an expert's gradient is reduced over the expert-data-parallel ranks
                set_tensor_model_parallel_attributes(param, axis is not None, axis or 0, 1)
                param.allreduce = not linear.lora.expert
            linear.register_forward_hook(_hook)
        model.ragen_lora = settings


def settings_of(chunk) -> LoraSettings | None:
    from ragen_mega.backends.megatron.chunk import unwrap

    return getattr(unwrap(chunk), "ragen_lora", None)


def is_adapter(param_name: str) -> bool:
    return ".lora." in param_name


def adapters(model: nn.Module):
    """(the linear's local parameter name, its LoraLinear) of a bare chunk."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            yield name[: -len(".lora")] + ".weight", module


def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Local parameter name -> merged shard of every adapted weight of a bare chunk."""
    with torch.no_grad():
        return {name: lora.merged(model.get_submodule(name[: -len(".weight")]).weight)
                for name, lora in adapters(model)}


def adapter_tensors(model: nn.Module):
    """(key, this rank's parameter, TP axis) for every adapter matrix of a bare chunk. The key
    is PEFT's name without its ``base_model.model.`` prefix
    (``model.layers.3.self_attn.q_proj.lora_A.weight``: global layer index, whole shape); the
    TP axis is the one the parameter is this rank's slice along (None: whole on every rank)."""
    for _, lora in adapters(model):
        yield from lora.tensors()


def sharded_state_dict(model: nn.Module) -> dict:
    """A LoRA checkpoint's part of a bare chunk: its adapters as ``ShardedTensor``s under their
    HF keys, and any other trained parameter (a critic's value head) as the model's own."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
    expert_dp_rank = mpu.get_expert_data_parallel_rank() if model.ragen_spec.is_moe else dp_rank
    out = {}
    for _, lora in adapters(model):
        # an expert's adapters have one owner per expert-parallel rank, replicas over expert DP
        dp = expert_dp_rank if lora.expert else dp_rank
        for key, param, axis in lora.tensors():
            if axis is None:   # replicas on the other TP and DP ranks: one of them writes
                out[key] = ShardedTensor.from_rank_offsets(key, param,
                                                           replica_id=(0, tp_rank, dp))
            else:
                out[key] = ShardedTensor.from_rank_offsets(key, param, (axis, tp_rank, tp),
                                                           replica_id=(0, 0, dp))
    trained = {id(p) for n, p in model.named_parameters() if p.requires_grad and not is_adapter(n)}
    if trained:
        out.update({k: v for k, v in model.sharded_state_dict().items()
                    if isinstance(v, ShardedTensor) and id(v.data) in trained})
    return out


def load_state_dict(model: nn.Module, loaded: dict) -> None:
    """Copy a loaded :func:`sharded_state_dict` into the chunk's adapters (and value head)."""
    with torch.no_grad():
        adapter_keys = set()
        for key, param, _ in adapter_tensors(model):
            param.copy_(loaded[key])
            adapter_keys.add(key)
        params = dict(model.named_parameters())
        for key, value in loaded.items():
            if key not in adapter_keys:
                params[key].copy_(value)
