"""Export a rank's Megatron model chunks as ``(hf_name, full tensor)`` pairs in the HF
checkpoint's names and shapes, whatever the TP x PP x EP layout (``models/mapping.py``): what the
weight sync sends the engines and what ``convert.py`` writes. A LoRA model exports its merged
weights (``lora.merged_weights``), never its adapters.

:func:`export_hf_state` gives every rank every tensor (collectives over TP, EP and PP);
:class:`DirectExport` sends each shard straight to one rank, for the streamed weight sync
(docs/design.md, "Weight sync, streamed").
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ragen_mega.backends.megatron import lora
from ragen_mega.backends.megatron.chunk import unwrap
from ragen_mega.backends.megatron.model import chunk_spec, local_params
from ragen_mega.backends.megatron.parallel import parallel_info
from ragen_mega.models import mapping
from ragen_mega.models.hf_config import ModelSpec


def export_hf_state(chunks, *, dst: int | None = None,
                    prefetch_bytes: int = 256 << 20) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model, one parameter at a time.

    ``dst=None``: ON EVERY RANK. The owning stage all-gathers a parameter's TP shards and
    converts them (an expert's owner then broadcasts over the expert-parallel group), then the
    result is broadcast over the pipeline group.
    ``dst=<global rank>`` (weight sync): only ``dst`` yields tensors, the ranks holding what it
    lacks send their shards straight to it (:class:`DirectExport`) instead of an all-gather to
    every TP rank (benchmarks/README.md, "Weight sync").

    Collectives: every rank must consume the iterator to the end, in step. Order: embedding,
    layers, head. Replicated parameters may be views of the live parameters: use them before
    the next optimizer step.
    """
    if dst is not None:
        yield from DirectExport(chunks, dst, prefetch_bytes)
        return
    spec, role = chunk_spec(chunks)
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
            if where.tp > 1 and mapping.rule_of(name, spec, role).is_tp_split:
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
    for hf_name in mapping.rule_of(name, spec, role).hf_names(name):
        tensor = (hf_tensors[hf_name].contiguous() if hf_tensors is not None else
                  torch.empty(mapping.hf_shape(hf_name, spec, role), dtype=dtype, device=device))
        dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)
        out[hf_name] = tensor
    return out


def _owned_params(chunks) -> dict[str, torch.Tensor]:
    """Global Megatron name -> this rank's (detached) parameter, over all its chunks. LoRA:
    adapted weights merged (copies that live as long as the export), adapters left out."""
    out = {}
    for model in map(unwrap, chunks):
        merged = lora.merged_weights(model)
        for local_name, p in local_params(model).items():
            if lora.is_adapter(local_name):
                continue
            out[mapping.to_global(local_name, model.ragen_layers.start,
                                  model.ragen_experts.start)] = merged.get(local_name, p.detach())
    return out


class DirectExport:
    """``export_hf_state(dst=...)``: every shard travels once, straight to ``dst``.

    Constructing it is the handshake, one small ``gather_object`` over all ranks: ``dst`` learns
    who holds what it lacks: dense weights from its model-parallel group (each rank's (pp, tp)
    and, from TP rank 0 of each stage, shard shapes and dtypes), an MoE model's experts from its
    expert-tensor-model-pipeline group (each (pp, ep, tp) rank's own experts). Ranks in neither
    group yield nothing. :attr:`layout` (on ``dst``) lists ``(hf_name, shape, dtype)`` of all it
    will yield, in order, before any shard moves, so the weight sender can announce a bucket
    before its tensors exist.

    Iterating it (every rank, in step) moves the shards in export order: each TP rank of the
    owning stage sends its shard cut into ``Rule.shard_pieces``; ``dst`` receives each piece
    into its view (``Rule.tp_pieces``) of a preallocated full tensor (column splits of
    row-parallel weights go through a staging buffer). A replicated parameter travels only when
    ``dst`` is in another stage (from its TP rank 0). Receives are posted up to
    ``prefetch_bytes`` ahead of what has been yielded, so the next bucket's shards arrive while
    the consumer sends one on; senders keep as many bytes in flight.
    """

    def __init__(self, chunks, dst: int, prefetch_bytes: int = 256 << 20):
        from megatron.core import parallel_state as mpu

        if prefetch_bytes <= 0:
            raise ValueError(f"export_hf_state: prefetch_bytes must be > 0, got {prefetch_bytes}")
        self.spec, self.role = chunk_spec(chunks)
        self.dst, self.prefetch_bytes = dst, prefetch_bytes
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
        return self.where.tp > 1 and self._rule(name).is_tp_split

    def _rule(self, name: str) -> mapping.Rule:
        return mapping.rule_of(name, self.spec, self.role)

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
        shape = (self._rule(name).full_shape(shard_shape, self.where.tp) if self._split(name)
                 else shard_shape)
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
                pieces = self._rule(name).shard_pieces(self.mine[name], self.where.tp)
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
        recvs, rule = [], self._rule(name)
        for r in range(self.where.tp):
            views = rule.tp_pieces(full, r, self.where.tp)
            if self._holder(name, owner_pp, r) == self.dst:
                own = rule.shard_pieces(self.mine[name], self.where.tp)
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
