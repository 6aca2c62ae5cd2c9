"""Build Megatron GPT model chunks for this rank and load HF weights into them.

Call after ``parallel.init_parallel``. A rank holds one chunk per virtual pipeline stage: a
megatron ``GPTModel`` (in ``Float16Module`` for bf16/fp16) that carries its spec, role, virtual
stage and global layer range (``.ragen_spec``, ``.ragen_role``, ``.ragen_vp_stage``,
``.ragen_layers``), so loading and export need nothing else.

Critic: the same backbone with ``output_layer`` replaced by ``ValueHead`` (a replicated
``Linear(hidden, 1)`` without bias, HF name ``score.weight``); GPTModel's post-process calls
``output_layer(hidden, weight=..., runtime_gather_output=...)`` and returns [b, s, 1], so the
schedule and forward code are the actor's.

Loading is strict: the checkpoint's names and shapes are checked against the config first
(``mapping.check_checkpoint`` names a wrong field), and every parameter of every chunk must be
written exactly once with its exact shape. Tensors are read lazily, only those this rank's
chunks need; a TP rank reads the full HF tensor and keeps its slice, so peak extra memory is one
full tensor. A critic built from an actor checkpoint ignores ``lm_head.weight`` and keeps a zero
value head when ``score.weight`` is absent.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ragen_mega.backends.megatron.chunk import unwrap
from ragen_mega.backends.megatron.parallel import parallel_info
from ragen_mega.backends.megatron.transformer_config import (block_spec, layer_spec,
                                                             megatron_config, te_available)
from ragen_mega.models import mapping
from ragen_mega.models.hf_config import ConfigMismatchError, ModelSpec, model_spec


class ValueHead(nn.Module):
    """Scalar value per token; replicated on every TP rank (its input is replicated, or, under
    sequence parallelism, gathered from the TP ranks' slices of the sequence first)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import (
                gather_from_sequence_parallel_region)

            hidden_states = gather_from_sequence_parallel_region(hidden_states,
                                                                 tensor_parallel_output_grad=False)
        return torch.matmul(hidden_states, self.weight.t()), None


def build_model(spec_or_hf_dir, *, role: str = "actor", dtype: torch.dtype = torch.float32,
                use_te: bool | None = None, local_attention: str = "sdpa",
                config_overrides: dict | None = None) -> list[nn.Module]:
    """This rank's model chunks (random init; ``load_hf_checkpoint`` fills them).
    ``use_te`` / ``local_attention``: the layer spec (``transformer_config.layer_spec``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    mapping._check_role(role)
    spec = spec_or_hf_dir if isinstance(spec_or_hf_dir, ModelSpec) else model_spec(spec_or_hf_dir)
    where = parallel_info()
    pp, vpp, pp_rank = where.pp, where.vpp, where.pp_rank
    config = megatron_config(spec, tp=where.tp, pp=pp, vpp=vpp, ep=where.ep, dtype=dtype,
                             **(config_overrides or {}))
    use_te = te_available() if use_te is None else use_te
    local_sp = config.sequence_parallel and not use_te   # the local spec's norms must allow SP
    layers = layer_spec(spec, use_te=use_te, local_attention=local_attention,
                        sequence_parallel=local_sp, grouped_gemm=config.moe_grouped_gemm)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre = mapping.chunk_has_embedding(pp_rank, pp, vpp, stage)
        post = mapping.chunk_has_head(pp_rank, pp, vpp, stage)
        layer_ids = mapping.chunk_layers(spec, pp_rank, pp, vpp, stage)
        block = block_spec(layers, len(layer_ids), local_sp)
        model = GPTModel(
            config=config, transformer_layer_spec=block, vocab_size=spec.padded_vocab(where.tp),
            max_sequence_length=spec.max_position_embeddings, pre_process=pre, post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tie_word_embeddings and role == "actor",
            position_embedding_type="rope", rotary_base=spec.rope_theta, vp_stage=stage)
        if role == "critic" and post:
            model.output_layer = ValueHead(spec.hidden_size, dtype, config.sequence_parallel)
        model.ragen_spec, model.ragen_role, model.ragen_vp_stage = spec, role, stage
        model.ragen_layers = layer_ids
        model.ragen_experts = (mapping.local_experts(spec, where.ep_rank, where.ep)
                               if spec.is_moe else range(0))
        if spec.is_moe:
            from ragen_mega.backends.megatron import routing

            _experts_apart(model)
            routing.install(model)
        if torch.cuda.is_available():  # norms and the value head are built on the CPU
            model.cuda(torch.cuda.current_device())
        if dtype in (torch.bfloat16, torch.float16):
            model = Float16Module(config, model)
        chunks.append(model)
    return chunks


def _experts_apart(model: nn.Module) -> None:
    """Mark the experts' weights ``allreduce=False`` at every EP (Megatron does only at EP > 1):
    their gradients are reduced over the expert-data-parallel group (at EP 1 the data-parallel
    group) and Adam keeps them in a second optimizer. Every EP then has the same two
    optimizers, so a checkpoint's optimizer state loads at any EP."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def chunk_spec(chunks) -> tuple[ModelSpec, str]:
    model = unwrap(chunks[0])
    return model.ragen_spec, model.ragen_role


def local_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Named parameters under the local-spec names (``mapping.local_spec_name``)."""
    return {mapping.local_spec_name(name): p for name, p in model.named_parameters()}


class _LazySafetensors(Mapping):
    """name -> tensor over all ``*.safetensors`` files in a directory, read on access."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open

        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {hf_dir}")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {}
        for handle, f in zip(self._handles, files):
            for name in handle.keys():
                if name in self._where:
                    raise ConfigMismatchError(f"tensor {name} appears in two files "
                                              f"({self._where[name][1]} and {f.name})")
                self._where[name] = (handle, f.name)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(h.get_slice(n).get_shape()) for n, (h, _) in self._where.items()}

    def __getitem__(self, name):
        return self._where[name][0].get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


def load_hf_checkpoint(chunks, hf_dir) -> None:
    """Copy this rank's shard of an HF checkpoint into ``chunks`` (strict, see module doc)."""
    hf_dir = Path(hf_dir)
    spec, role = chunk_spec(chunks)
    if (hf_dir / "config.json").exists():
        file_spec = model_spec(hf_dir, vocab_divisor=spec.vocab_divisor)
        if file_spec != spec:
            diff = {f: (getattr(spec, f), getattr(file_spec, f))
                    for f in spec.__dataclass_fields__ if getattr(spec, f) != getattr(file_spec, f)}
            raise ConfigMismatchError(f"{hf_dir}/config.json differs from the model's spec: "
                                      + ", ".join(f"{k}: model {a} vs file {b}"
                                                  for k, (a, b) in diff.items()))
    state = _LazySafetensors(hf_dir)
    shapes = state.shapes()
    if role == "critic":  # an actor checkpoint may seed a critic; the value head is optional
        shapes.pop("lm_head.weight", None)
        shapes.pop("score.weight", None)
    mapping.check_checkpoint(spec, shapes, role)
    where = parallel_info()
    for chunk in chunks:
        model = unwrap(chunk)
        params = local_params(model)
        written = set()
        with torch.no_grad():
            for name, tensor in mapping.iter_hf_to_megatron_shard(
                    state, spec, where.tp_rank, where.tp, where.pp_rank, where.pp, vpp=where.vpp,
                    vp_stage=model.ragen_vp_stage, role=role, ep_rank=where.ep_rank,
                    ep_size=where.ep):
                if name not in params:
                    raise KeyError(f"mapping produced {name}, which the model chunk lacks")
                if params[name].shape != tensor.shape:
                    raise ConfigMismatchError(f"{name}: shard shape {tuple(tensor.shape)} != "
                                              f"model parameter {tuple(params[name].shape)}")
                params[name].copy_(tensor)
                written.add(name)
            if role == "critic" and "output_layer.weight" in params \
                    and "output_layer.weight" not in written:
                params["output_layer.weight"].zero_()
                written.add("output_layer.weight")
        unwritten = sorted(set(params) - written)
        if unwritten:
            raise KeyError(f"model parameters not filled from {hf_dir}: {unwritten[:5]}")
