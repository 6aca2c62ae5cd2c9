"""Build Megatron GPT model chunks for this rank, load HF weights into them, export them back.

Call after ``parallel.init_parallel``. A rank holds one chunk per virtual pipeline stage; each
is a megatron ``GPTModel`` (in ``Float16Module`` for bf16/fp16) that carries its spec, role,
virtual stage and global layer range (``.ragen_spec``, ``.ragen_role``, ``.ragen_vp_stage``,
``.ragen_layers``), so loading and export need nothing else. Export yields ``(hf_name, full
tensor)`` pairs; :class:`DirectExport` also knows, before any tensor moves, what it will yield
(``.layout``), which lets the weight sync stream.

Critic: the same GPTModel backbone with ``output_layer`` replaced by ``ValueHead`` (a plain
replicated ``Linear(hidden, 1)`` without bias, HF name ``score.weight``); GPTModel's post-process
calls ``output_layer(hidden, weight=..., runtime_gather_output=...)`` and returns its output as
[b, s, 1], so the schedule and forward code are shared with the actor.

Loading is strict: the checkpoint's names and shapes are checked against the config first
(``mapping.check_checkpoint``: a wrong field is named), and every parameter of every chunk must
be written exactly once with its exact shape. Tensors are read lazily, one at a time, and only
those this rank's chunks need (a PP stage never reads another stage's layers); a TP rank reads
the full HF tensor and keeps its slice, so peak extra memory is one full tensor.
A critic built from an actor checkpoint ignores ``lm_head.weight`` and keeps a zero value head
when ``score.weight`` is absent.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ragen_mega.backends.megatron import lora
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


def _as_spec(spec_or_hf_dir) -> ModelSpec:
    return spec_or_hf_dir if isinstance(spec_or_hf_dir, ModelSpec) else model_spec(spec_or_hf_dir)


def build_model(spec_or_hf_dir, *, role: str = "actor", dtype: torch.dtype = torch.float32,
                use_te: bool | None = None, local_attention: str = "sdpa",
                config_overrides: dict | None = None) -> list[nn.Module]:
    """This rank's model chunks (random init; ``load_hf_checkpoint`` fills them).
    ``use_te`` / ``local_attention``: the layer spec (``transformer_config.layer_spec``)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    mapping._check_role(role)
    spec = _as_spec(spec_or_hf_dir)
    tp = mpu.get_tensor_model_parallel_world_size()
    pp = mpu.get_pipeline_model_parallel_world_size()
    vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    ep, ep_rank = _expert_parallel()
    config = megatron_config(spec, tp=tp, pp=pp, vpp=vpp, ep=ep, dtype=dtype,
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
        block = block_spec(layers, len(mapping.chunk_layers(spec, pp_rank, pp, vpp, stage)),
                           local_sp)
        model = GPTModel(
            config=config, transformer_layer_spec=block, vocab_size=spec.padded_vocab(tp),
            max_sequence_length=spec.max_position_embeddings, pre_process=pre, post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tie_word_embeddings and role == "actor",
            position_embedding_type="rope", rotary_base=spec.rope_theta, vp_stage=stage)
        if role == "critic" and post:
            model.output_layer = ValueHead(spec.hidden_size, dtype, config.sequence_parallel)
        model.ragen_spec, model.ragen_role, model.ragen_vp_stage = spec, role, stage
        model.ragen_layers = mapping.chunk_layers(spec, pp_rank, pp, vpp, stage)
        model.ragen_experts = (mapping.local_experts(spec, ep_rank, ep) if spec.is_moe
                               else range(0))
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
    """Mark the experts' weights as Megatron does at expert parallel size > 1 only
    (``allreduce=False``): their gradients are then reduced over the expert-data-parallel
    group and Adam keeps them in a second optimizer. At EP 1 that group is the data-parallel
    group (the same reduction), and every EP has the same two optimizers, so a checkpoint's
    optimizer state loads at any EP (one optimizer at EP 1 and two at EP 2 do not)."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def _expert_parallel() -> tuple[int, int]:
    """(size, rank) of this rank's expert-parallel group."""
    from megatron.core import parallel_state as mpu

    return mpu.get_expert_model_parallel_world_size(), mpu.get_expert_model_parallel_rank()


def chunk_spec(chunks) -> tuple[ModelSpec, str]:
    model = unwrap(chunks[0])
    return model.ragen_spec, model.ragen_role


def _local_params(model: nn.Module) -> dict[str, nn.Parameter]:
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


def load_hf_checkpoint(chunks, hf_dir, spec: ModelSpec | None = None) -> None:
    """Copy this rank's shard of an HF checkpoint into ``chunks`` (strict, see module doc)."""
    from megatron.core import parallel_state as mpu

    hf_dir = Path(hf_dir)
    own_spec, role = chunk_spec(chunks)
    spec = spec or own_spec
    if spec != own_spec:
        raise ConfigMismatchError(f"load_hf_checkpoint: spec {spec} differs from the one the "
                                  f"model was built with {own_spec}")
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
    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    pp = mpu.get_pipeline_model_parallel_world_size()
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
    ep, ep_rank = _expert_parallel()
    for chunk in chunks:
        model = unwrap(chunk)
        params = _local_params(model)
        written = set()
        with torch.no_grad():
            for name, tensor in mapping.iter_hf_to_megatron_shard(
                    state, spec, tp_rank, tp, pp_rank, pp, vpp=vpp, vp_stage=model.ragen_vp_stage,
                    role=role, ep_rank=ep_rank, ep_size=ep):
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


def export_hf_state(chunks, spec: ModelSpec | None = None, *, dst: int | None = None,
                    prefetch_bytes: int = 256 << 20) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model, one parameter at a time.

    ``dst=None``: ON EVERY RANK. For each parameter the owning pipeline stage all-gathers its TP
    shards and converts them to HF tensors (an expert's: its expert-parallel rank, which then
    broadcasts them over the expert-parallel group), which are then broadcast over the pipeline
    group.
    ``dst=<global rank>`` (weight sync: only the sending rank needs the tensors): the ranks that
    hold what ``dst`` lacks send their shards straight to ``dst`` (point to point, into place,
    see ``DirectExport``); ``dst`` yields the tensors, the other ranks yield nothing. An
    all-gather moves every shard to every TP rank (and gloo's is ~5x slower than send/recv of
    the same bytes on loopback).

    These are collectives: every rank must consume the iterator to the end, in step. Order:
    embedding, layers, head. Replicated parameters may be yielded as views of the live
    parameters: use them before the next optimizer step.
    """
    if dst is not None:
        yield from DirectExport(chunks, dst, spec, prefetch_bytes)
        return
    own_spec, role = chunk_spec(chunks)
    spec = spec or own_spec
    from megatron.core import parallel_state as mpu

    tp_group = mpu.get_tensor_model_parallel_group()
    where = parallel_info()
    mine = _owned_params(chunks)
    dtype, device = next(iter(mine.values())).dtype, where.device
    for name in mapping.megatron_names(spec, role):
        owner_pp, _ = mapping.owner(name, spec, where.pp, where.vpp)
        owner_ep = mapping.expert_owner(name, spec, where.ep)
        hf_tensors = None
        if name in mine:
            shards = [mine[name].contiguous()]
            if where.tp > 1 and mapping.is_tp_split(name, spec, role):
                shards = [torch.empty_like(shards[0]) for _ in range(where.tp)]
                dist.all_gather(shards, mine[name].contiguous(), group=tp_group)
            hf_tensors = dict(mapping.megatron_to_hf([(name, shards)], spec, role))
        if owner_ep is not None and where.ep > 1 and owner_pp == where.pp_rank:
            hf_tensors = _broadcast_hf(hf_tensors, name, spec, role, owner_ep,
                                       mpu.get_expert_model_parallel_group(), dtype, device)
        if where.pp > 1:
            hf_tensors = _broadcast_hf(hf_tensors, name, spec, role, owner_pp,
                                       mpu.get_pipeline_model_parallel_group(), dtype, device)
        yield from hf_tensors.items()


def _broadcast_hf(hf_tensors: dict | None, name: str, spec: ModelSpec, role: str, src: int,
                  group, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """The HF tensors of one Megatron parameter, broadcast from the group's rank ``src`` (which
    has them) to the others (which pass None and learn the shapes from the mapping)."""
    out = {}
    for hf_name in mapping.hf_names(name, spec, role):
        tensor = (hf_tensors[hf_name].contiguous() if hf_tensors is not None else
                  torch.empty(mapping.hf_shape(hf_name, spec, role), dtype=dtype, device=device))
        dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)
        out[hf_name] = tensor
    return out


def _owned_params(chunks) -> dict[str, torch.Tensor]:
    """Global Megatron name -> this rank's (detached) parameter, over all its chunks. A LoRA
    model's adapted weights are merged (``lora.merged_weights``: base + s * B A, copies that
    live as long as the export) and its adapters are not parameters of the HF model."""
    out = {}
    for model in map(unwrap, chunks):
        merged = lora.merged_weights(model)
        for local_name, p in _local_params(model).items():
            if lora.is_adapter(local_name):
                continue
            out[mapping.to_global(local_name, model.ragen_layers.start,
                                  model.ragen_experts.start)] = merged.get(local_name, p.detach())
    return out


class DirectExport:
    """``export_hf_state(dst=...)``: every shard travels once, straight to ``dst``.

    Constructing it is the handshake, a collective over all ranks (one small ``gather_object``):
    ``dst`` learns who holds what it lacks: the dense weights from its model-parallel group
    (each rank's (pp, tp) rank and, from TP rank 0 of each stage, its shard shapes and dtypes),
    an MoE model's experts from its expert-tensor-model-pipeline group (each (pp, ep, tp)
    rank's shards of its own experts). Ranks in neither group yield nothing. On ``dst``,
    :attr:`layout` then lists ``(hf_name, shape, dtype)`` of
    everything the iteration will yield, in order, before any shard has moved: a consumer can
    announce a bucket before its tensors exist (the weight sender streams them as they land).

    Iterating it (every rank, in step) moves the shards: in the export order, each TP rank of the
    owning stage sends its shard cut into ``mapping.shard_pieces``, and ``dst`` receives each
    piece straight into its view (``mapping.tp_pieces``) of a preallocated full tensor: row
    splits need no merge copy; column splits (row-parallel weights) land in a staging buffer and
    are copied into place. A replicated parameter travels only when ``dst`` is in another stage
    (from that stage's TP rank 0). Receives are posted up to ``prefetch_bytes`` ahead of what
    has been yielded, so while the consumer sends one bucket on, the next one's shards are
    already arriving; senders keep as many bytes in flight.
    """

    def __init__(self, chunks, dst: int, spec: ModelSpec | None = None,
                 prefetch_bytes: int = 256 << 20):
        from megatron.core import parallel_state as mpu

        if prefetch_bytes <= 0:
            raise ValueError(f"export_hf_state: prefetch_bytes must be > 0, got {prefetch_bytes}")
        own_spec, self.role = chunk_spec(chunks)
        self.spec, self.dst, self.prefetch_bytes = spec or own_spec, dst, prefetch_bytes
        self.layout: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None
        self.where = parallel_info()
        dense = set(dist.get_process_group_ranks(mpu.get_model_parallel_group()))
        experts = (set(dist.get_process_group_ranks(
            mpu.get_expert_tensor_model_pipeline_parallel_group())) if self.spec.is_moe
            else set())
        # a dense weight comes from dst's model-parallel group, an expert from its expert group
        self.sends_dense, self.sends_experts = dst in dense, dst in experts
        self.member = self.sends_dense or self.sends_experts
        self.tp_group = mpu.get_tensor_model_parallel_group()
        self.mine = _owned_params(chunks) if self.member else {}
        self.names = mapping.megatron_names(self.spec, self.role)
        meta = {n: (tuple(p.shape), p.dtype) for n, p in self.mine.items()
                if self.where.tp_rank == 0
                and (self.sends_experts if self._expert(n) else self.sends_dense)}
        gathered = [None] * self.where.world_size if self.where.rank == dst else None
        dist.gather_object((self.where.rank, self.where.pp_rank, self.where.tp_rank,
                            self.where.ep_rank, meta), gathered, dst=dst)
        if self.where.rank != dst:
            return
        self.rank_of = {(p, t): g for g, p, t, _, _ in gathered if g in dense}
        self.expert_rank_of = {(p, e, t): g for g, p, t, e, _ in gathered if g in experts}
        self.shapes = {n: sm for g, *_, m in gathered if g in dense | experts
                       for n, sm in m.items()}
        # the conversion itself, run on meta tensors: exactly the names/shapes/dtypes it yields
        self.layout = [(hf_name, tuple(t.shape), t.dtype) for name in self.names
                       for hf_name, t in mapping.megatron_to_hf(
                           [(name, self._full(name, device="meta"))], self.spec, self.role)]

    def _expert(self, name: str) -> bool:
        return mapping.expert_owner(name, self.spec, self.where.ep) is not None

    def _split(self, name: str) -> bool:
        return self.where.tp > 1 and mapping.is_tp_split(name, self.spec, self.role)

    def _holder(self, name: str, owner_pp: int, tp_rank: int) -> int:
        """The global rank that holds TP shard ``tp_rank`` of a parameter of stage
        ``owner_pp`` (an expert's: on its expert-parallel rank)."""
        if self._expert(name):
            owner_ep = mapping.expert_owner(name, self.spec, self.where.ep)
            return self.expert_rank_of[owner_pp, owner_ep, tp_rank]
        return self.rank_of[owner_pp, tp_rank]

    def _full(self, name: str, device) -> torch.Tensor:
        """An empty full (TP-merged) tensor for ``name``, as ``dst`` assembles it."""
        shard_shape, dtype = self.shapes[name]
        shape = (mapping.full_shape(name, shard_shape, self.spec, self.where.tp, self.role)
                 if self._split(name) else shard_shape)
        return torch.empty(shape, dtype=dtype, device=device)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.member:
            return iter(())
        return self._receive() if self.where.rank == self.dst else self._send()

    def _send(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A shard holder: post its pieces in export order, a bounded number of bytes ahead."""
        dst_in_my_stage = self.dst in dist.get_process_group_ranks(self.tp_group)
        in_flight, pending = 0, deque()
        for name in self.names:
            if name not in self.mine:
                continue
            if not (self.sends_experts if self._expert(name) else self.sends_dense):
                continue
            if self._split(name):
                pieces = mapping.shard_pieces(name, self.mine[name], self.spec, self.where.tp,
                                              self.role)
            elif self._expert(name) or (not dst_in_my_stage and self.where.tp_rank == 0):
                pieces = [self.mine[name]]   # dst holds no copy of it
            else:
                continue
            for piece in pieces:
                while pending and in_flight > self.prefetch_bytes:
                    work, sent = pending.popleft()
                    work.wait()
                    in_flight -= sent.nbytes
                piece = piece.contiguous()  # kept referenced until its send completes
                pending.append((dist.isend(piece, self.dst), piece))
                in_flight += piece.nbytes
        for work, _ in pending:
            work.wait()
        yield from ()

    def _post(self, name: str, device):
        """Post one parameter's receives: (full, [(work, receive buffer, its view in full)])."""
        if name in self.mine and not self._split(name):
            return self.mine[name], []
        owner_pp = mapping.owner(name, self.spec, self.where.pp, self.where.vpp)[0]
        full = self._full(name, device)
        if not self._split(name):
            return full, [(dist.irecv(full, self._holder(name, owner_pp, 0)), full, full)]
        recvs = []
        for r in range(self.where.tp):
            views = mapping.tp_pieces(name, full, self.spec, r, self.where.tp, self.role)
            if self._holder(name, owner_pp, r) == self.dst:
                own = mapping.shard_pieces(name, self.mine[name], self.spec, self.where.tp,
                                           self.role)
                for view, piece in zip(views, own):
                    view.copy_(piece)
                continue
            for view in views:
                buf = view if view.is_contiguous() else torch.empty_like(view, memory_format=
                                                                          torch.contiguous_format)
                recvs.append((dist.irecv(buf, self._holder(name, owner_pp, r)), buf, view))
        return full, recvs

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        device = next(iter(self.mine.values())).device
        queue, ahead, upcoming = deque(), 0, iter(self.names)
        for name in self.names:
            while not queue or ahead < self.prefetch_bytes:  # keep prefetch_bytes posted
                nxt = next(upcoming, None)
                if nxt is None:
                    break
                full, recvs = self._post(nxt, device)
                queue.append((full, recvs))
                ahead += full.nbytes
            full, recvs = queue.popleft()
            ahead -= full.nbytes
            for work, buf, view in recvs:
                work.wait()
                if buf is not view:
                    view.copy_(buf)
            yield from mapping.megatron_to_hf([(name, full)], self.spec, self.role)
