"""The ``config.json`` of the Hub models the examples name, for a plan made without the weights.

``ragen-mega plan`` sizes a run from its model's architecture, but the examples' ``model.path``
(``/path/to/Qwen2.5-7B-Instruct``, ...) is not on a laptop planning a cluster run. Values as
published on the Hub:

- https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct/blob/main/config.json
- https://huggingface.co/Qwen/Qwen2.5-3B-Instruct/blob/main/config.json
- https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json
- https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
"""
from __future__ import annotations

from pathlib import PurePosixPath

_QWEN2 = {"model_type": "qwen2", "hidden_act": "silu", "max_position_embeddings": 32768,
          "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}

KNOWN_CONFIGS: dict[str, dict] = {
    "Qwen2.5-0.5B-Instruct": {**_QWEN2, "hidden_size": 896, "intermediate_size": 4864,
                              "num_hidden_layers": 24, "num_attention_heads": 14,
                              "num_key_value_heads": 2, "vocab_size": 151936,
                              "tie_word_embeddings": True},
    "Qwen2.5-3B-Instruct": {**_QWEN2, "hidden_size": 2048, "intermediate_size": 11008,
                            "num_hidden_layers": 36, "num_attention_heads": 16,
                            "num_key_value_heads": 2, "vocab_size": 151936,
                            "tie_word_embeddings": True},
    "Qwen2.5-7B-Instruct": {**_QWEN2, "hidden_size": 3584, "intermediate_size": 18944,
                            "num_hidden_layers": 28, "num_attention_heads": 28,
                            "num_key_value_heads": 4, "vocab_size": 152064,
                            "tie_word_embeddings": False},
    "Qwen3-30B-A3B": {"model_type": "qwen3_moe", "hidden_act": "silu", "hidden_size": 2048,
                      "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
                      "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                      "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
}


def known_config(path: str) -> dict | None:
    """The published config.json of the model ``path`` names by its last component
    (``/path/to/Qwen2.5-7B-Instruct``, ``Qwen/Qwen3-30B-A3B``; case-insensitive); None for
    any other model."""
    name = PurePosixPath(path.rstrip("/")).name.lower()
    return next((dict(c) for n, c in KNOWN_CONFIGS.items() if n.lower() == name), None)
