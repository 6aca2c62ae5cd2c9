"""Core attention of Megatron's local layer spec as one ``F.scaled_dot_product_attention`` call.

Without TransformerEngine, Megatron's local spec uses ``DotProductAttention``, which
materialises the [b, heads, s, s] scores, masks and soft-maxes them in separate kernels and
repeats GQA's K/V heads: on a GPU that costs speed and memory (benchmarks/README.md).
``SDPAttention`` computes the same causal softmax(q k^T / sqrt(d)) v in one SDPA call (flash /
memory-efficient kernels on CUDA, torch's fused kernel on a CPU; GQA without copying K/V).

It is a drop-in ``core_attention`` (``layer_spec(..., local_attention="sdpa")``) with
``DotProductAttention``'s constructor and forward contract (query [sq, b, heads, d], key/value
[sk, b, groups, d] -> context [sq, b, heads * d], this TP rank's heads), so TP splits it as the
original. Right padding needs no mask: under causal attention a real token never sees the
padding after it, and the trainer zeroes what is computed at padded positions. What the
trainer never uses is refused, not computed differently: an explicit attention mask, attention
bias, packed sequences, sliding windows, softmax variants, attention dropout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """``DotProductAttention`` whose forward is one fused causal SDPA call (module docstring)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        refused = {"window_size": config.window_size is not None,
                   "softmax_type": config.softmax_type != "vanilla",
                   "attention_dropout": (kwargs.get("attention_dropout")
                                         or config.attention_dropout) > 0,
                   "attn_mask_type": attn_mask_type != AttnMaskType.causal}
        bad = [name for name, hit in refused.items() if hit]
        if bad:
            raise ValueError(f"SDPAttention supports causal self-attention without dropout, "
                             f"windows or softmax variants; the config sets {bad} "
                             f"(use local_attention='unfused')")
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        # DotProductAttention splits 1/sqrt(d) into softmax_scale and a softmax-side factor when
        # apply_query_key_layer_scaling is on; SDPA takes the product
        self.sdpa_scale = self.softmax_scale * (self.layer_number
                                                if config.apply_query_key_layer_scaling else 1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_mask is not None or attention_bias is not None \
                or packed_seq_params is not None:
            raise ValueError("SDPAttention computes plain causal attention: attention_mask, "
                             "attention_bias and packed_seq_params must be None")
        # [s, b, heads, d] -> [b, heads, s, d] views; SDPA reads the strides
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.sdpa_scale,
            enable_gqa=q.shape[1] != k.shape[1])
        # [b, heads, sq, d] -> [sq, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
