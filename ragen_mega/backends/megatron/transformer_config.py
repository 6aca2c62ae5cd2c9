"""``ModelSpec`` -> megatron-core ``TransformerConfig`` + layer spec: the Megatron half of reading
an HF model, kept in the backend so that ``models/`` and the config layer import no megatron.

:func:`megatron_config` sets what makes Megatron compute what transformers computes (and the CPU
settings: docs/cpu_stack.md, "Settings"); :func:`layer_spec` picks TransformerEngine's layer spec
when it imports, the local one otherwise, whose core attention is ``local_attention``
(``models.hf_config.LOCAL_ATTENTIONS``; ``"sdpa"``: ``sdpa_attention.SDPAttention``).
"""
from __future__ import annotations

import torch

from ragen_mega.models.hf_config import LOCAL_ATTENTIONS, LocalAttention, ModelSpec


def megatron_config(spec: ModelSpec, *, tp: int = 1, pp: int = 1, vpp: int | None = None,
                    ep: int = 1, dtype: torch.dtype = torch.float32, **overrides):
    """The ``TransformerConfig`` that computes what transformers computes for ``spec``.

    Fusions are off, and ``use_cpu_initialization`` is on without a GPU (docs/cpu_stack.md);
    ``moe_token_dispatcher_type="alltoall"`` + ``variable_seq_lengths`` let the pipeline
    schedule take micro-batches of different lengths. ``overrides`` go to TransformerConfig.
    """
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    spec.check_parallel(tp, pp, vpp, ep)
    cuda = torch.cuda.is_available()
    kwargs = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads, num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
        # megatron-core trains an MoE layer under TP only with sequence parallelism (each TP
        # rank routes its slice of the sequence; forward.py pads lengths to a multiple of TP)
        sequence_parallel=spec.is_moe and tp > 1,
        params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=not cuda, variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall", batch_p2p_sync=cuda,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    if spec.is_moe:
        kwargs.update(moe_config(spec))
    if vpp:
        # Interleaved 1F1B with batched p2p at pp=2 (next stage == previous stage) trades
        # activations and gradients with one peer in one batch, and they arrive swapped (on
        # gloo: wrong gradients, or a shape error for ragged micro-batches). Megatron-LM's
        # setting for interleaving, overlapped unbatched p2p, is exact.
        kwargs.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def moe_config(spec: ModelSpec) -> dict:
    """The ``TransformerConfig`` settings of a qwen2_moe / qwen3_moe MLP (``spec.is_moe``).

    Routing as transformers: a softmax over all experts' router logits, the top k kept. With
    ``norm_topk_prob`` the k probabilities are renormalised to sum to 1, which is Megatron's
    softmax *after* the top-k (``moe_router_pre_softmax=False``); without it they stay
    fractions of the full softmax (``pre_softmax=True``); tests/test_moe.py checks the
    log-probs against transformers. The router runs in fp32. ``SequentialMLP`` experts unless
    overridden with ``moe_grouped_gemm=True`` (:func:`layer_spec`). No load-balancing loss
    unless overridden (``ModelTrainingConfig.moe_aux_loss_coeff``): the policy loss alone
    trains the router."""
    shared = spec.shared_expert_ffn_hidden_size
    return dict(num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_top_k,
                moe_ffn_hidden_size=spec.moe_ffn_hidden_size, moe_grouped_gemm=False,
                moe_router_score_function="softmax",
                moe_router_pre_softmax=not spec.moe_norm_topk_prob, moe_router_dtype="fp32",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_shared_expert_intermediate_size=shared or None,
                moe_shared_expert_gate=bool(shared), moe_shared_expert_overlap=False)


#: why ``moe_grouped_gemm`` cannot be on here (the start-up check puts the config key in front)
GROUPED_GEMM_NEEDS_TE = ("grouped-GEMM experts are TransformerEngine's TEGroupedMLP, which needs "
                         "TransformerEngine on a GPU; this machine has none")


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "no TE"
        return False
    return torch.cuda.is_available()


def layer_spec(spec: ModelSpec, *, use_te: bool | None = None, local_attention: LocalAttention = "sdpa",
               sequence_parallel: bool = False, grouped_gemm: bool = False):
    """TransformerEngine layer spec on GPU with TE installed; Megatron's local spec otherwise.

    ``grouped_gemm`` (``moe_grouped_gemm``): each layer's local experts run as one grouped GEMM,
    TransformerEngine's ``TEGroupedMLP``. It needs the TE spec: Megatron's only grouped-GEMM
    experts without TE, the deprecated ``GroupedMLP``, need the ``grouped_gemm`` CUDA package,
    train in bf16 only and keep all experts in one transposed tensor the mapping does not speak.

    ``local_attention`` picks the local spec's core attention: ``"sdpa"``
    (``sdpa_attention.SDPAttention``) or ``"unfused"`` (Megatron's ``DotProductAttention``,
    kept as the reference). ``sequence_parallel``: the local spec's norms are
    ``SequenceParallelRMSNorm`` (torch's refuses it; the final norm too: :func:`block_spec`).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)

    if local_attention not in LOCAL_ATTENTIONS:
        raise ValueError(f"local_attention must be one of {LOCAL_ATTENTIONS}, "
                         f"got {local_attention!r}")
    if use_te is None:
        use_te = te_available()
    if grouped_gemm and not use_te:
        raise ValueError(f"moe_grouped_gemm: {GROUPED_GEMM_NEEDS_TE} (leave it false: one "
                         f"linear per expert)")
    experts = dict(num_experts=spec.num_experts or None,
                   moe_grouped_gemm=bool(grouped_gemm and spec.is_moe))
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_layernorm,
                                                          **experts)
    layers = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_layernorm,
                                      **experts)
    if local_attention == "sdpa":
        from ragen_mega.backends.megatron.sdpa_attention import SDPAttention

        layers.submodules.self_attention.submodules.core_attention = SDPAttention
    if sequence_parallel:
        from ragen_mega.backends.megatron.sequence_parallel_norm import SequenceParallelRMSNorm

        layers.submodules.input_layernorm = SequenceParallelRMSNorm
        layers.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
        attention = layers.submodules.self_attention.submodules
        if spec.qk_layernorm:
            attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
    return layers


def block_spec(layers, num_layers: int, sequence_parallel: bool):
    """The transformer block of ``num_layers`` layers of spec ``layers``, as GPTModel makes it,
    except that with ``sequence_parallel`` (local spec) its final norm is
    ``SequenceParallelRMSNorm`` too."""
    if not sequence_parallel:
        return layers
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from ragen_mega.backends.megatron.sequence_parallel_norm import SequenceParallelRMSNorm

    return TransformerBlockSubmodules(layer_specs=[layers] * num_layers,
                                      layer_norm=SequenceParallelRMSNorm)

