"""Routing replay for mixtures of experts: the trainer's forward through the experts the engine
chose (slime's ``--use-rollout-routing-replay``, "R3").

Engine and trainer route from router logits that differ in the last bits (other kernels,
batch shapes, bf16 on one side): a near tie flips, the token goes through other experts, and the
trainer's log-prob of a sampled token is not the engine's. The batch's ``routed_experts``
[B, S, layers, top-k] holds in column t token t's experts as the engine chose them, -1 where it
has none (padding, and the last token). Every MoE layer's router gets an :class:`EngineRouting`
(megatron-core's routers call ``router_replay.get_replay_topk`` when one is set; ours is per
model, not in megatron-core's class-level ``RouterReplay`` list), which always counts the routing
mismatch and, with replay, takes the engine's experts at the router's own scores, so the router
still trains. Tokens without engine routing keep their own experts.
(docs/design.md, "Routing replay")
"""
from __future__ import annotations

import torch

from ragen_mega.backends.megatron.chunk import unwrap


class EngineRouting:
    """One MoE layer's router hook: the engine's experts of the tokens in flight, whether to
    replay them, and the mismatch counts (differing pairs, compared pairs) since the last
    :func:`take_mismatch_counts`."""

    def __init__(self):
        self.target: torch.Tensor | None = None   # [tokens, top-k], Megatron's [s*b] order
        self.replay = False
        self.counts = torch.zeros(2, dtype=torch.float64)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups,
                                          group_topk=group_topk)
        if self.target is None:
            return probs, own
        target = self.target.to(own.device)
        if target.shape != own.shape:
            raise ValueError(f"routed_experts: {tuple(target.shape)} engine routings for a "
                             f"layer that routed {tuple(own.shape)} (tokens, top-k)")
        known = (target >= 0).all(dim=-1)
        with torch.no_grad():   # counted where the tokens are: no device sync per layer
            differ = (own.sort(dim=-1).values != target.sort(dim=-1).values).any(dim=-1)
            self.counts = self.counts.to(own.device) + torch.stack(
                [(differ & known).sum(), known.sum()]).double()
        if not self.replay:
            return probs, own
        chosen = torch.where(known.unsqueeze(-1), target, own)
        return scores.gather(1, chosen), chosen


def install(chunk) -> None:
    """Give every MoE layer of a model chunk its :class:`EngineRouting` (``build_model`` does)."""
    for layer in unwrap(chunk).decoder.layers:
        layer.mlp.router.router_replay = EngineRouting()


def _hooks(chunk) -> list[tuple[int, EngineRouting]]:
    """(global layer index, hook) of a chunk's MoE layers (none in a dense model)."""
    model = unwrap(chunk)
    if not model.ragen_spec.is_moe:
        return []
    return [(model.ragen_layers.start + i, layer.mlp.router.router_replay)
            for i, layer in enumerate(model.decoder.layers)]


def set_engine_routing(chunk, routed_experts: torch.Tensor | None, replay: bool) -> None:
    """The engine's experts of the micro-batch a chunk is about to read: ``routed_experts``
    [b, s, layers, top-k] (None: route on its own, count nothing). Under sequence parallelism
    a TP rank's routers see only its slice of the positions (``s`` a multiple of TP)."""
    from megatron.core import parallel_state as mpu

    if routed_experts is not None and unwrap(chunk).config.sequence_parallel:
        tp, rank = (mpu.get_tensor_model_parallel_world_size(),
                    mpu.get_tensor_model_parallel_rank())
        routed_experts = routed_experts.chunk(tp, dim=1)[rank]
    for layer, hook in _hooks(chunk):
        if routed_experts is None:
            hook.target = None
            continue
        b, s = routed_experts.shape[:2]
        # Megatron's tokens are [s, b] flattened: position-major
        hook.target = routed_experts[:, :, layer].transpose(0, 1).reshape(s * b, -1).long()
        hook.replay = replay


def take_mismatch_counts(chunks) -> torch.Tensor:
    """[differing (token, layer) pairs, compared pairs] counted by this rank's layers since the
    last call (which resets them)."""
    total = torch.zeros(2, dtype=torch.float64)
    for chunk in chunks:
        for _, hook in _hooks(chunk):
            total += hook.counts.cpu()
            hook.counts = torch.zeros(2, dtype=torch.float64)
    return total
