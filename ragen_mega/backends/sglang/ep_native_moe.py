"""An SGLang server plugin for CPU servers: expert parallelism in the pure-torch MoE path.

With ``--ep-size`` > 1 the router's top-k ids reach the MoE kernel as local indices, -1 for
another rank's expert (that rank adds its part when the layer sums the ranks' outputs). GPU
kernels skip -1; SGLang 0.5.23's ``fused_moe_native.moe_forward_native`` indexes with it, so the
plugin computes such a batch itself (gated SiLU MLPs without biases; any other raises
``NotImplementedError``) and leaves other batches to the original (docs/cpu_stack.md, "Plugins").
"""
from __future__ import annotations


def ep_native_moe_plugin() -> None:
    """SGLang general plugin: ``moe_forward_native`` that leaves other ranks' experts out."""
    import torch

    if torch.cuda.is_available():
        return
    from sglang.srt.layers.moe import fused_moe_native

    original = fused_moe_native.moe_forward_native

    def moe_forward_native(layer, x, topk_output, moe_runner_config):
        ids, weights = topk_output.topk_ids, topk_output.topk_weights
        experts = layer.w13_weight.shape[0]
        if bool(((ids >= 0) & (ids < experts)).all()):
            return original(layer, x, topk_output, moe_runner_config)
        if (moe_runner_config.activation != "silu" or moe_runner_config.gemm1_alpha is not None
                or getattr(layer, "w13_weight_bias", None) is not None):
            raise NotImplementedError(f"ragen_mega ep_native_moe: expert parallelism on CPU for "
                                      f"a gated SiLU MLP without biases only, got activation "
                                      f"{moe_runner_config.activation!r}")
        out = torch.zeros(x.shape, dtype=weights.dtype, device=x.device)
        for expert in range(experts):
            token, slot = (ids == expert).nonzero(as_tuple=True)
            if not len(token):
                continue
            gate, up = torch.nn.functional.linear(x[token], layer.w13_weight[expert]).chunk(2, -1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                           layer.w2_weight[expert])
            out.index_add_(0, token, y.to(weights.dtype) * weights[token, slot, None])
        return out.to(x.dtype)

    fused_moe_native.moe_forward_native = moe_forward_native
