"""Hugging Face ``config.json`` -> ``ModelSpec``: what a backend, the conversion and the weight
sync read about a model, with no megatron-core import (the Megatron ``TransformerConfig`` and
layer spec built from it live in ``backends/megatron/transformer_config.py``).

``LocalAttention`` / ``LOCAL_ATTENTIONS`` (the local layer spec's core attentions) are here,
importing nothing, so the run's config and the Megatron backend share one list without the
config layer loading megatron.

Supported families: llama (SmolLM2, Llama 2/3 without rope scaling), qwen2 (q/k/v biases),
qwen3 (q/k RMSNorm per head, head_dim may differ from hidden/heads), and their mixtures of
experts: qwen3_moe (Qwen3-30B-A3B, 235B-A22B) and qwen2_moe (adds a gated shared expert), every
layer's MLP a router over ``num_experts`` experts, ``num_experts_per_tok`` per token. Anything
this trainer would compute differently (rope scaling, sliding window, biases on other
projections, another activation, dense layers among the sparse ones) is refused with an error
naming the config key.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, get_args

ARCHS = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
MOE_ARCHS = ("qwen2_moe", "qwen3_moe")


class ConfigMismatchError(ValueError):
    """A checkpoint's tensors contradict its config (or the config is unsupported)."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool
    qk_layernorm: bool
    vocab_divisor: int = 128   # each TP rank's vocab shard is a multiple of this
    #: mixtures of experts (0: a dense MLP): experts per layer, experts per token, each
    #: expert's intermediate size, whether the chosen experts' probabilities are renormalised
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = False
    #: qwen2_moe's shared expert (0: none), which every token goes through, scaled by a gate
    shared_expert_ffn_hidden_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def padded_vocab(self, tp: int = 1) -> int:
        """Rows of the padded embedding: a multiple of ``vocab_divisor * tp`` that is the SAME
        for every power-of-two TP up to 8, so a checkpoint saved at one such TP loads at another
        (Megatron-LM's ``divisor * tp`` rule gives Qwen2.5 151936 rows at TP1, 152064 at TP2)."""
        mult = math.lcm(self.vocab_divisor * 8, self.vocab_divisor * tp)
        return -(-self.vocab_size // mult) * mult

    def check_parallel(self, tp: int = 1, pp: int = 1, vpp: int | None = None,
                       ep: int = 1) -> None:
        """Raise a ValueError naming the size that a TP / PP / EP layout cannot split."""
        if ep != 1 and not self.is_moe:
            raise ValueError(f"expert parallel size {ep} needs a mixture of experts; "
                             f"model_type={self.arch} has none")
        if self.is_moe and (ep < 1 or self.num_experts % ep):
            raise ValueError(f"expert parallel size {ep} does not divide "
                             f"num_experts={self.num_experts}")
        mlp = ((("moe_intermediate_size", self.moe_ffn_hidden_size),
                ("shared_expert_intermediate_size", self.shared_expert_ffn_hidden_size))
               if self.is_moe else (("intermediate_size", self.ffn_hidden_size),))
        for name, value in (("num_attention_heads", self.num_heads),
                            ("num_key_value_heads", self.num_kv_heads), *mlp):
            if value % tp:
                raise ValueError(f"tensor parallel size {tp} does not divide {name}={value}")
        chunks = pp * (vpp or 1)
        if self.num_layers % chunks:
            raise ValueError(f"pipeline layout pp={pp} x vpp={vpp or 1} does not divide "
                             f"num_hidden_layers={self.num_layers}")


def _load_config_dict(config_or_dir) -> dict:
    if isinstance(config_or_dir, Mapping):
        return dict(config_or_dir)
    if hasattr(config_or_dir, "to_dict"):
        return config_or_dir.to_dict()
    path = Path(config_or_dir)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no HF config at {path}")
    return read_config_json(path)


def read_config_json(path) -> dict:
    """The JSON object in ``path`` (an HF ``config.json``). Anything else raises ``ValueError``
    naming the file (and for a syntax error the line and column): ``json``'s own message names
    no file, and the conversion CLI prints only the message."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: byte {e.start} ({e.reason})") from e
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: line {e.lineno}, column {e.colno}: "
                         f"{e.msg}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def _rope_theta(cfg: dict) -> float:
    """transformers 5 keeps it in ``rope_parameters``; older configs at top level."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ConfigMismatchError(f"rope_type={rope_type!r} (rope scaling) is not supported; "
                                  "only plain RoPE")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ConfigMismatchError("config has no rope theta (rope_parameters['rope_theta'] "
                                  "or rope_theta)")
    return float(theta)


def model_spec(config_or_dir, *, vocab_divisor: int = 128) -> ModelSpec:
    """Read an HF config (dict, PretrainedConfig, directory or config.json path)."""
    cfg = _load_config_dict(config_or_dir)
    arch = cfg.get("model_type")
    if arch not in ARCHS:
        raise ConfigMismatchError(f"model_type={arch!r} is not supported; expected one of {ARCHS}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigMismatchError(f"hidden_act={cfg['hidden_act']!r} is not supported (silu only)")
    if cfg.get("mlp_bias"):
        raise ConfigMismatchError("mlp_bias=True is not supported")
    if cfg.get("use_sliding_window"):
        raise ConfigMismatchError("use_sliding_window=True is not supported")
    attention_bias = bool(cfg.get("attention_bias", False))
    if arch == "llama" and attention_bias:
        raise ConfigMismatchError("attention_bias=True (a bias on o_proj too) is not supported "
                                  "for llama")
    moe = _moe_fields(cfg) if arch in MOE_ARCHS else {}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                *(() if moe else ("intermediate_size",)))
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ConfigMismatchError(f"HF config lacks {missing}")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    family = arch.removesuffix("_moe")
    return ModelSpec(
        arch=arch, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
        ffn_hidden_size=cfg.get("intermediate_size", 0), vocab_size=cfg["vocab_size"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=_rope_theta(cfg), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        # qwen2 always has q/k/v biases (no config key; qwen2_moe's is qkv_bias); qwen3 only
        # with attention_bias
        qkv_bias=(arch == "qwen2" or (arch == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))
                  or (family == "qwen3" and attention_bias)),
        qk_layernorm=family == "qwen3", vocab_divisor=vocab_divisor, **moe)


def _moe_fields(cfg: dict) -> dict:
    """The :class:`ModelSpec` fields of a qwen2_moe / qwen3_moe config. The expert count is
    ``num_experts`` in the Hub's configs and ``num_local_experts`` in some saved ones."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    missing = [k for k, v in (("num_experts", experts),
                              ("num_experts_per_tok", cfg.get("num_experts_per_tok")),
                              ("moe_intermediate_size", cfg.get("moe_intermediate_size")))
               if not v]
    if missing:
        raise ConfigMismatchError(f"model_type={cfg['model_type']!r}: HF config lacks {missing}")
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise ConfigMismatchError(f"decoder_sparse_step={cfg['decoder_sparse_step']} (dense "
                                  f"layers between the sparse ones) is not supported; only 1")
    if cfg.get("mlp_only_layers"):
        raise ConfigMismatchError(f"mlp_only_layers={cfg['mlp_only_layers']} (dense layers "
                                  f"among the sparse ones) is not supported; only []")
    if cfg["num_experts_per_tok"] > experts:
        raise ConfigMismatchError(f"num_experts_per_tok={cfg['num_experts_per_tok']} exceeds "
                                  f"num_experts={experts}")
    return {"num_experts": int(experts), "moe_top_k": int(cfg["num_experts_per_tok"]),
            "moe_ffn_hidden_size": int(cfg["moe_intermediate_size"]),
            "moe_norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "shared_expert_ffn_hidden_size": int(cfg.get("shared_expert_intermediate_size")
                                                 or 0) if cfg["model_type"] == "qwen2_moe" else 0}


# the local layer spec's core attention (transformer_config.layer_spec): "sdpa" = one fused
# scaled_dot_product_attention call, "unfused" = Megatron's DotProductAttention
LocalAttention = Literal["sdpa", "unfused"]
LOCAL_ATTENTIONS = get_args(LocalAttention)
