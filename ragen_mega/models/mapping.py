"""THE one parameter mapping HF <-> Megatron (llama / qwen2 / qwen3 and their MoE forms), for
conversion and weight sync.

The table is :func:`rules` (layer rules use ``"{i}"``); the other functions answer questions
about it for a ``spec`` (a ``ModelSpec``) and a ``role`` ("actor": LM head, "critic": value
head): which pipeline chunk holds which parameters and, through :func:`rule_of`, one
parameter's :class:`Rule`: its names on each side and how a TP split cuts it. Loading uses
``iter_hf_to_megatron_shard``, export ``megatron_to_hf`` (full tensors or TP shards in TP-rank
order). :func:`check_checkpoint` names the config field a tensor contradicts.

Names. Megatron names are those of ``GPTModel`` built with the *local* layer spec
(``decoder.layers.3.self_attention.linear_qkv.weight``). A "global" name carries the global layer
index, a chunk's own ``named_parameters`` local ones (``to_local``/``to_global`` convert).
:func:`local_spec_name` renames the TE layer spec's parameters (pre-norms fused into the
linears, grouped-GEMM experts) to the local spec's.

Layouts (the reasons the table exists):
- ``linear_qkv`` is grouped per KV head: for each group g, its q heads, then k_g, then v_g
  (megatron splits ``[ng, (np/ng + 2) * hn]``), not a plain ``[q; k; v]`` stack. Groups are
  contiguous, so the TP split of the fused tensor is a contiguous row split.
- ``linear_fc1`` is ``[gate; up]`` on EVERY TP rank: rank r holds ``[gate_r; up_r]``, so the
  split/merge works on the halves, not on the fused rows.
- Column-parallel weights split dim 0, row-parallel dim 1, norms are replicated; embedding and
  output layer are vocab-parallel over rows padded to ``spec.padded_vocab(tp)`` (zeros; the
  padding is dropped again on the way back, and masked out of the softmax by forward.py).
- Tied embeddings: with PP > 1 the last stage holds its own ``output_layer.weight`` copy, loaded
  from ``model.embed_tokens.weight``; it is never exported (HF has no lm_head when tied).
- Critic: same backbone; ``output_layer.weight`` is a replicated [1, hidden] value head, HF name
  ``score.weight``, optional on load (an actor checkpoint has none: the head stays zero).
- Mixtures of experts (``spec.is_moe``): Megatron's ``MoELayer`` with ``SequentialMLP``
  experts. The router ``mlp.router.weight`` is HF's ``mlp.gate.weight`` (replicated); expert
  e's ``linear_fc1`` / ``linear_fc2`` are HF's ``mlp.experts.{e}.gate_proj``/``up_proj`` and
  ``down_proj`` (transformers' on-disk names; it fuses them in memory only), split over TP as a
  dense MLP's. qwen2_moe's shared expert is ``mlp.shared_experts.linear_fc1/fc2``, its sigmoid
  gate ``mlp.shared_experts.gate_weight`` (HF ``mlp.shared_expert_gate.weight``, [1, hidden],
  replicated).

Streaming: ``megatron_to_hf`` handles one parameter at a time, so a weight sync can gather,
convert, send and drop each before the next. ``Rule.tp_pieces`` is the one description of how
a TP split cuts the full tensor (``Rule.split``/``Rule.merge`` use it): each piece is a view,
contiguous for row splits, so shards can be received straight into place.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from ragen_mega.models.hf_config import ConfigMismatchError, ModelSpec

ROLES = ("actor", "critic")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_INDEX = re.compile(r"\.local_experts\.(\d+)\.")

# TE spec name -> local spec name (the TE linears carry the preceding norm's weight)
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
# TEGroupedMLP's per-expert weights: local expert j of a layer's grouped fc1 / fc2
_TE_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.linear_fc([12])\.weight(\d+)$")


def local_spec_name(name: str) -> str:
    """A TE-layer-spec parameter name (fused pre-norms, grouped-GEMM ``weight{j}`` per local
    expert) as the local spec, and the rules, call it; a local-spec name comes back unchanged.
    TE's grouped expert weights have the shape of the ``SequentialMLP`` linear they replace
    (``[out / TP, in]``, gate and up halves per TP rank alike)."""
    for te_name, local_name in _TE_ALIASES.items():
        if name.endswith(te_name):
            return name[: -len(te_name)] + local_name
    return _TE_GROUPED_EXPERT.sub(lambda m: f".mlp.experts.local_experts.{m.group(2)}"
                                            f".linear_fc{m.group(1)}.weight", name)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One Megatron parameter's row of the table, and the conversions and TP cuts it implies."""
    megatron: str                 # name template; "{i}" = layer index
    hf: tuple[str, ...]           # HF name templates fused (in order) into this parameter
    fuse: str = "none"            # "none" | "qkv" | "gate_up"
    tp_dim: int | None = None     # 0 column-parallel, 1 row-parallel, None replicated
    vocab: bool = False           # rows are the padded vocabulary
    place: str = "layer"          # "layer" | "embedding" (first chunk) | "head" (last chunk)
    export: bool = True           # False: a copy of another parameter (tied output under PP)
    optional: bool = False        # may be absent from an HF checkpoint (critic value head)
    expert: int | None = None     # the (global) expert this parameter belongs to

    @property
    def is_tp_split(self) -> bool:
        """Whether TP ranks hold different slices of this parameter (False: replicated)."""
        return self.tp_dim is not None

    def hf_names(self, global_name: str) -> tuple[str, ...]:
        """The HF names of ``global_name`` (a parameter of this rule), in fusion order."""
        layer = _layer_index(global_name)
        return tuple(n.format(i=layer) for n in self.hf)

    def from_hf(self, tensors: Sequence[torch.Tensor], spec: ModelSpec,
                tp_size: int) -> torch.Tensor:
        """The full (TP=1 layout) Megatron tensor from its HF tensors (in ``hf`` order)."""
        if self.fuse == "qkv":
            return _fuse_qkv(*tensors, spec)
        if self.fuse == "gate_up":
            return torch.cat(tensors, dim=0)
        (t,) = tensors
        if self.vocab:
            pad = spec.padded_vocab(tp_size) - t.shape[0]
            if pad:
                t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])], dim=0)
        return t

    def to_hf(self, full: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, ...]:
        """The HF tensors (in ``hf`` order) of a full Megatron tensor; vocabulary padding
        dropped."""
        if self.fuse == "qkv":
            return _unfuse_qkv(full, spec)
        if self.fuse == "gate_up":
            return tuple(full.chunk(2, dim=0))
        return (full[: spec.vocab_size] if self.vocab else full,)

    def tp_pieces(self, full: torch.Tensor, tp_rank: int, tp_size: int) -> list[torch.Tensor]:
        """Views of ``full`` (TP=1 layout) that TP rank ``tp_rank`` holds, in the order its
        shard stacks them along ``tp_dim`` (a receiver can fill ``full`` without a merge copy)."""
        if self.tp_dim is None or tp_size == 1:
            return [full]
        if self.fuse == "gate_up":  # rank r holds [gate_r; up_r]
            return [half.chunk(tp_size, 0)[tp_rank] for half in full.chunk(2, dim=0)]
        if full.shape[self.tp_dim] % tp_size:
            raise ValueError(f"{self.megatron}: dim {self.tp_dim} of shape {tuple(full.shape)} "
                             f"does not split over tp={tp_size}")
        return [full.chunk(tp_size, dim=self.tp_dim)[tp_rank]]

    def shard_pieces(self, shard: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
        """A TP shard cut (as views) into the pieces :meth:`tp_pieces` places into the full
        tensor."""
        if self.tp_dim is None or tp_size == 1:
            return [shard]
        meta = torch.empty(self.full_shape(shard.shape, tp_size), device="meta")
        sizes = [v.shape[self.tp_dim] for v in self.tp_pieces(meta, 0, tp_size)]
        return list(shard.split(sizes, dim=self.tp_dim))

    def full_shape(self, shard_shape: Sequence[int], tp_size: int) -> tuple[int, ...]:
        """Shape of the full (TP=1 layout) tensor whose TP shards have ``shard_shape``."""
        shape = list(shard_shape)
        if self.tp_dim is not None:
            shape[self.tp_dim] *= tp_size
        return tuple(shape)

    def split(self, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        """TP rank ``tp_rank``'s shard of a full (TP=1 layout) Megatron tensor."""
        pieces = self.tp_pieces(full, tp_rank, tp_size)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.tp_dim)

    def merge(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full (TP=1 layout) Megatron tensor from the TP shards in TP-rank order."""
        if self.tp_dim is None or len(shards) == 1:
            return shards[0]
        full = shards[0].new_empty(self.full_shape(shards[0].shape, len(shards)))
        for tp_rank, shard in enumerate(shards):
            for view, part in zip(self.tp_pieces(full, tp_rank, len(shards)),
                                  self.shard_pieces(shard, len(shards))):
                view.copy_(part)
        return full

    def hf_to_shard(self, hf_tensors: Sequence[torch.Tensor], spec: ModelSpec, tp_rank: int,
                    tp_size: int) -> torch.Tensor:
        """TP rank ``tp_rank``'s shard of this parameter from its HF tensors (in ``hf``
        order); ``backends/megatron/lora.py`` feeds it row and column indices."""
        return self.split(self.from_hf(hf_tensors, spec, tp_size), tp_rank, tp_size)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")


@functools.lru_cache(maxsize=64)
def rules(spec: ModelSpec, role: str = "actor") -> tuple[Rule, ...]:
    """The table for one model (cached: a weight sync looks rules up once per parameter)."""
    _check_role(role)
    L, A = "decoder.layers.{i}.", "model.layers.{i}."
    attn = [Rule(L + "self_attention.linear_qkv.weight",
                 tuple(A + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv", 0)]
    if spec.qkv_bias:
        attn.append(Rule(L + "self_attention.linear_qkv.bias",
                         tuple(A + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv", 0))
    if spec.qk_layernorm:
        attn += [Rule(L + "self_attention.q_layernorm.weight", (A + "self_attn.q_norm.weight",)),
                 Rule(L + "self_attention.k_layernorm.weight", (A + "self_attn.k_norm.weight",))]
    table = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), tp_dim=0,
             vocab=True, place="embedding"),
        Rule(L + "input_layernorm.weight", (A + "input_layernorm.weight",)),
        *attn,
        Rule(L + "self_attention.linear_proj.weight", (A + "self_attn.o_proj.weight",), tp_dim=1),
        Rule(L + "pre_mlp_layernorm.weight", (A + "post_attention_layernorm.weight",)),
        *(_moe_rules(spec) if spec.is_moe else _mlp_rules(L + "mlp.", A + "mlp.")),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",), place="head"),
    ]
    if role == "critic":
        table.append(Rule("output_layer.weight", ("score.weight",), place="head", optional=True))
    elif spec.tie_word_embeddings:  # exists only on a last chunk without the embedding (PP > 1)
        table.append(Rule("output_layer.weight", ("model.embed_tokens.weight",), tp_dim=0,
                          vocab=True, place="head", export=False))
    else:
        table.append(Rule("output_layer.weight", ("lm_head.weight",), tp_dim=0, vocab=True,
                          place="head"))
    return tuple(table)


def _mlp_rules(megatron: str, hf: str, expert: int | None = None) -> list[Rule]:
    """A gated MLP's two linears (a dense layer's, an expert's, the shared expert's)."""
    return [Rule(megatron + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"),
                 "gate_up", 0, expert=expert),
            Rule(megatron + "linear_fc2.weight", (hf + "down_proj.weight",), tp_dim=1,
                 expert=expert)]


def _moe_rules(spec: ModelSpec) -> list[Rule]:
    """The router, every expert (its index written into the names) and the shared expert."""
    L, A = "decoder.layers.{i}.mlp.", "model.layers.{i}.mlp."
    out = [Rule(L + "router.weight", (A + "gate.weight",))]
    for e in range(spec.num_experts):
        out += _mlp_rules(L + f"experts.local_experts.{e}.", A + f"experts.{e}.", e)
    if spec.shared_expert_ffn_hidden_size:
        out += [*_mlp_rules(L + "shared_experts.", A + "shared_expert."),
                Rule(L + "shared_experts.gate_weight", (A + "shared_expert_gate.weight",))]
    return out


@functools.lru_cache(maxsize=64)
def _rules_by_name(spec: ModelSpec, role: str) -> dict[str, Rule]:
    """Megatron name template -> rule (an MoE table has a few hundred rules per layer)."""
    return {rule.megatron: rule for rule in rules(spec, role)}


def adaptable_rules(spec: ModelSpec, role: str = "actor") -> list[Rule]:
    """The linears a LoRA adapter may wrap: a layer's TP-split ones (qkv, output projection, every
    MLP's fc1 and fc2) and an actor's untied LM head; not the router, embedding or value head."""
    layer = [r for r in rules(spec, role) if r.place == "layer" and r.tp_dim is not None
             and r.megatron.endswith(".weight")]
    head = [r for r in rules(spec, role) if r.place == "head" and r.vocab and r.export]
    return layer + ([] if spec.tie_word_embeddings else head)


# ---------------------------------------------------------------------------------------------
# pipeline placement

def _check_stage(pp_rank: int, pp_size: int, vpp: int | None, vp_stage: int | None) -> int:
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} outside [0, pp_size={pp_size})")
    if vpp is None:
        if vp_stage not in (None, 0):
            raise ValueError(f"vp_stage={vp_stage} given without vpp")
        return 0
    if vp_stage is None or not 0 <= vp_stage < vpp:
        raise ValueError(f"vp_stage={vp_stage} must be in [0, vpp={vpp})")
    return vp_stage


def chunk_layers(spec: ModelSpec, pp_rank: int, pp_size: int, vpp: int | None = None,
                 vp_stage: int | None = None) -> range:
    """Global layer ids of one model chunk; Megatron's even split (interleaved when vpp)."""
    vp_stage = _check_stage(pp_rank, pp_size, vpp, vp_stage)
    spec.check_parallel(1, pp_size, vpp)
    per_chunk = spec.num_layers // (pp_size * (vpp or 1))
    start = (vp_stage * pp_size + pp_rank) * per_chunk
    return range(start, start + per_chunk)


def chunk_has_embedding(pp_rank: int, pp_size: int, vpp: int | None = None,
                        vp_stage: int | None = None) -> bool:
    return pp_rank == 0 and _check_stage(pp_rank, pp_size, vpp, vp_stage) == 0


def chunk_has_head(pp_rank: int, pp_size: int, vpp: int | None = None,
                   vp_stage: int | None = None) -> bool:
    vp_stage = _check_stage(pp_rank, pp_size, vpp, vp_stage)
    return pp_rank == pp_size - 1 and vp_stage == (vpp or 1) - 1


def local_experts(spec: ModelSpec, ep_rank: int = 0, ep_size: int = 1) -> range:
    """Global indices of the experts expert-parallel rank ``ep_rank`` holds (Megatron gives each
    rank a contiguous block; its ``local_experts.{j}`` is global expert ``start + j``)."""
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} outside [0, ep_size={ep_size})")
    spec.check_parallel(ep=ep_size)
    per_rank = spec.num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def expert_owner(global_name: str, spec: ModelSpec, ep_size: int) -> int | None:
    """The expert-parallel rank that holds an expert parameter; None for any other parameter
    (those every expert-parallel rank holds)."""
    m = _EXPERT_INDEX.search(global_name)
    return None if m is None else int(m.group(1)) // (spec.num_experts // ep_size)


def to_local(name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """A global name as a chunk calls it: layer ids less the chunk's first layer, expert ids
    less its expert-parallel rank's first expert."""
    m = _LAYER.match(name)
    if m:
        name = f"decoder.layers.{int(m.group(1)) - layer_offset}.{name[m.end():]}"
    if expert_offset:
        name = _EXPERT_INDEX.sub(lambda e: f".local_experts.{int(e.group(1)) - expert_offset}.",
                                 name)
    return name


def to_global(name: str, layer_offset: int, expert_offset: int = 0) -> str:
    return to_local(name, -layer_offset, -expert_offset)


def _layer_index(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def _present(rule: Rule, has_embedding: bool, has_head: bool) -> bool:
    if rule.place == "embedding":
        return has_embedding
    if rule.place == "head":
        # a tied output layer is a separate parameter only where the embedding is not
        return has_head and (rule.export or not has_embedding)
    return True


def megatron_names(spec: ModelSpec, role: str = "actor") -> list[str]:
    """Every exported global Megatron name, embedding first, layers in order, head last."""
    table = [r for r in rules(spec, role) if r.export]
    names = [r.megatron for r in table if r.place == "embedding"]
    layer_rules = [r for r in table if r.place == "layer"]
    for i in range(spec.num_layers):
        names += [r.megatron.format(i=i) for r in layer_rules]
    return names + [r.megatron for r in table if r.place == "head"]


def chunk_param_names(spec: ModelSpec, pp_rank: int, pp_size: int, vpp: int | None = None,
                      vp_stage: int | None = None, role: str = "actor", *, ep_rank: int = 0,
                      ep_size: int = 1) -> list[tuple[str, str]]:
    """(global, local) names of the parameters one model chunk holds (on expert-parallel rank
    ``ep_rank``: its own experts only)."""
    layers = chunk_layers(spec, pp_rank, pp_size, vpp, vp_stage)
    emb = chunk_has_embedding(pp_rank, pp_size, vpp, vp_stage)
    head = chunk_has_head(pp_rank, pp_size, vpp, vp_stage)
    experts = local_experts(spec, ep_rank, ep_size) if spec.is_moe else range(0)
    out = []
    for rule in rules(spec, role):
        if not _present(rule, emb, head) or (rule.expert is not None
                                             and rule.expert not in experts):
            continue
        if rule.place == "layer":
            out += [(name, to_local(name, layers.start, experts.start))
                    for name in (rule.megatron.format(i=i) for i in layers)]
        else:
            out.append((rule.megatron, rule.megatron))
    return out


def owner(global_name: str, spec: ModelSpec, pp_size: int, vpp: int | None = None
          ) -> tuple[int, int]:
    """(pp_rank, vp_stage) of the chunk that holds an exported global parameter."""
    rule = rule_of(global_name, spec, None)
    if rule.place == "embedding":
        return 0, 0
    if rule.place == "head":
        return pp_size - 1, (vpp or 1) - 1
    per_chunk = spec.num_layers // (pp_size * (vpp or 1))
    chunk = _layer_index(global_name) // per_chunk
    return chunk % pp_size, chunk // pp_size


def rule_of(global_name: str, spec: ModelSpec, role: str | None = "actor") -> Rule:
    """The rule of one global Megatron parameter name (its HF names, fusion, TP split); role
    None: the exported rule of either role. KeyError for a name the model has not."""
    layer = _layer_index(global_name)
    template = global_name if layer is None else to_local(global_name, layer).replace(
        "decoder.layers.0.", "decoder.layers.{i}.", 1)
    for candidate_role in ([role] if role else ROLES):
        rule = _rules_by_name(spec, candidate_role).get(template)
        if rule is not None and (role or rule.export):
            if layer is not None and layer >= spec.num_layers:
                raise KeyError(f"{global_name}: layer {layer} >= num_layers {spec.num_layers}")
            return rule
    raise KeyError(f"{global_name} is not a Megatron parameter of a {spec.arch} "
                   f"{role or 'model'}")


# ---------------------------------------------------------------------------------------------
# tensor layouts

def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    g, hd = spec.num_kv_heads, spec.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(g, (spec.num_heads // g) * hd, *rest), k.reshape(g, hd, *rest),
             v.reshape(g, hd, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _unfuse_qkv(fused: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, ...]:
    g, hd = spec.num_kv_heads, spec.head_dim
    rest = fused.shape[1:]
    per_group = (spec.num_heads // g) * hd
    q, k, v = fused.reshape(g, per_group + 2 * hd, *rest).split([per_group, hd, hd], dim=1)
    return tuple(t.reshape(-1, *rest) for t in (q, k, v))


# ---------------------------------------------------------------------------------------------
# the two directions

def iter_hf_to_megatron_shard(hf_state: Mapping[str, torch.Tensor], spec: ModelSpec,
                              tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1, *,
                              vpp: int | None = None, vp_stage: int | None = None,
                              role: str = "actor", ep_rank: int = 0, ep_size: int = 1
                              ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (local Megatron name, this TP rank's shard) for one model chunk (of expert-parallel
    rank ``ep_rank``: its own experts only). ``hf_state`` is indexed only by the names the chunk
    needs (a lazy view works); a missing non-optional HF tensor raises KeyError naming it."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} outside [0, tp_size={tp_size})")
    spec.check_parallel(tp_size, pp_size, vpp)
    for global_name, local_name in chunk_param_names(spec, pp_rank, pp_size, vpp, vp_stage, role,
                                                     ep_rank=ep_rank, ep_size=ep_size):
        rule = rule_of(global_name, spec, role)
        names = rule.hf_names(global_name)
        missing = [n for n in names if n not in hf_state]
        if missing:
            if rule.optional:
                continue
            raise KeyError(f"HF checkpoint lacks {missing[0]} (needed for {global_name})")
        yield local_name, rule.hf_to_shard([hf_state[n] for n in names], spec, tp_rank,
                                           tp_size).clone()


def megatron_to_hf(items: Iterable[tuple[str, torch.Tensor | Sequence[torch.Tensor]]],
                   spec: ModelSpec, role: str = "actor") -> Iterator[tuple[str, torch.Tensor]]:
    """Convert (global Megatron name, full tensor or list of TP shards) pairs to HF pairs: one
    to three HF tensors per item, nothing held between items, vocabulary padding dropped, a tied
    output layer's copy skipped."""
    for name, value in items:
        rule = rule_of(name, spec, role)
        if not rule.export:
            continue
        full = rule.merge(list(value)) if isinstance(value, (list, tuple)) else value
        yield from zip(rule.hf_names(name), rule.to_hf(full, spec))


# HF config key -> ModelSpec attribute (shape errors speak the HF key the user can fix)
CONFIG_KEY_TO_SPEC = {
    "hidden_size": "hidden_size", "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
    "intermediate_size": "ffn_hidden_size", "vocab_size": "vocab_size",
    "num_experts": "num_experts", "moe_intermediate_size": "moe_ffn_hidden_size",
    "shared_expert_intermediate_size": "shared_expert_ffn_hidden_size",
}
_EXPERT = re.compile(r"mlp\.experts\.\d+\.")
_ONE = ("", 1)   # a dimension of size 1 (the shared expert's gate has one output)


def hf_shape(hf_name: str, spec: ModelSpec, role: str = "actor") -> tuple[int, ...]:
    """The shape an HF tensor has for ``spec`` (the critic's ``score.weight`` is [1, hidden])."""
    if role == "critic" and hf_name == "score.weight":
        return (1, spec.hidden_size)
    dims = expected_hf_shapes(spec, role)[hf_name]
    return tuple(getattr(spec, CONFIG_KEY_TO_SPEC[key]) * factor if key else factor
                 for key, factor in dims)


def expected_hf_shapes(spec: ModelSpec, role: str = "actor") -> dict[str, tuple]:
    """HF tensor name -> dims as (config key, factor): the size is ``config[key] * factor``
    (so :func:`check_checkpoint` can name the key a tensor contradicts)."""
    H, V, F = ("hidden_size", 1), ("vocab_size", 1), ("intermediate_size", 1)
    E, M = ("num_experts", 1), ("moe_intermediate_size", 1)
    S = ("shared_expert_intermediate_size", 1)
    hd = spec.head_dim
    q, kv = ("num_attention_heads", hd), ("num_key_value_heads", hd)
    per_suffix = {
        "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
        "self_attn.v_proj.weight": (kv, H), "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (H, q), "self_attn.q_norm.weight": (("head_dim", 1),),
        "self_attn.k_norm.weight": (("head_dim", 1),), "mlp.gate_proj.weight": (F, H),
        "mlp.up_proj.weight": (F, H), "mlp.down_proj.weight": (H, F),
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "model.embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "model.norm.weight": (H,),
        "mlp.gate.weight": (E, H), "mlp.experts.E.gate_proj.weight": (M, H),
        "mlp.experts.E.up_proj.weight": (M, H), "mlp.experts.E.down_proj.weight": (H, M),
        "mlp.shared_expert.gate_proj.weight": (S, H), "mlp.shared_expert.up_proj.weight": (S, H),
        "mlp.shared_expert.down_proj.weight": (H, S), "mlp.shared_expert_gate.weight": (_ONE, H),
    }
    out = {}
    for rule in rules(spec, role):
        if rule.optional:
            continue
        layers = range(spec.num_layers) if rule.place == "layer" else [None]
        for template in rule.hf:
            suffix = _EXPERT.sub("mlp.experts.E.", template.split("{i}.")[-1])
            for i in layers:
                out[template.format(i=i)] = per_suffix[suffix]
    return out


def check_checkpoint(spec: ModelSpec, shapes: Mapping[str, Sequence[int]],
                     role: str = "actor") -> None:
    """Compare a checkpoint's HF tensor ``shapes`` (e.g. from safetensors headers) with
    ``spec``. Raises ConfigMismatchError for a wrong dimension (naming the config key, its value
    and the value the tensor implies), a missing tensor or an unexpected one; a critic's
    optional ``score.weight`` is not required."""
    expected = expected_hf_shapes(spec, role)
    for name, dims in expected.items():
        if name not in shapes:
            raise ConfigMismatchError(f"checkpoint lacks tensor {name} that the config implies "
                                      f"({_describe(spec, name)})")
        shape = tuple(shapes[name])
        if len(shape) != len(dims):
            raise ConfigMismatchError(f"tensor {name} has shape {shape}, expected "
                                      f"{len(dims)} dims")
        for dim, (size, (field, factor)) in enumerate(zip(shape, dims)):
            if not field:
                if size != factor:
                    raise ConfigMismatchError(f"tensor {name} has shape {shape}, expected "
                                              f"{factor} in dim {dim}")
                continue
            value = getattr(spec, CONFIG_KEY_TO_SPEC[field])
            if size != value * factor:
                implied = f"{size / factor:g}" if size % factor == 0 else f"{size}/{factor}"
                raise ConfigMismatchError(f"{field}: config says {value}, checkpoint tensor "
                                          f"{name} has shape {shape}, implying {implied}")
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        raise ConfigMismatchError(f"checkpoint has tensors the config does not imply: "
                                  f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} "
                                  f"({_hint(spec, unexpected[0])})")


def _describe(spec: ModelSpec, name: str) -> str:
    if name == "lm_head.weight":
        return f"tie_word_embeddings={spec.tie_word_embeddings}"
    if ".bias" in name:
        return f"model_type={spec.arch} has q/k/v biases"
    if "_norm" in name and "self_attn" in name:
        return f"model_type={spec.arch} has q/k norms"
    return f"num_hidden_layers={spec.num_layers}"


def _hint(spec: ModelSpec, name: str) -> str:
    if name == "lm_head.weight":
        return f"tie_word_embeddings: config says {spec.tie_word_embeddings}"
    if name.startswith("model.layers."):
        index = int(name.split(".")[2])
        if index >= spec.num_layers:
            return f"num_hidden_layers: config says {spec.num_layers}, checkpoint has layer {index}"
    if ".bias" in name or "_norm" in name:
        return f"model_type: config says {spec.arch}"
    return "not part of a llama/qwen2/qwen3 causal LM"
