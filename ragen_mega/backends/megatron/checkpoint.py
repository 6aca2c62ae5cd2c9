"""Atomic, resharding Megatron checkpoints: model + optimizer + LR schedule + step + user state.

Saving and loading are collectives (every rank calls them); loading compares the model's
architecture signature with the checkpoint's and names the field that differs.

Layout of ``<root>``::

    step_12/            a complete checkpoint (only ever appears by one atomic rename)
      dist/             megatron dist_checkpointing, torch_dist format (global tensor keys)
      ragen_state.pt    step, optimizer step count, scheduler state, user ``extra``, signature
                        (LoRA: rank, alpha, targets) and ``lora_base`` (LoRA: the base model's
                        dir); plain values and tensors only, read with ``weights_only=True``
      hf/               config.json + tokenizer files of the model (so export needs no HF dir)
    .tmp-step_13/       a save in progress, or one that was killed: never looks complete

A LoRA model (``lora.py``) saves only its adapters and their Adam state, under their HF names
(``model.layers.3.self_attn.q_proj.lora_A.weight``); its base weights stay the HF directory's.

torch_dist stores tensors under their *global* names and shapes, so a checkpoint written at
one TP x PP (x VPP) layout loads at any other. The plain optimizer's state reshards fully;
DistributedOptimizer's without TE/Apex only over DP (``dp_reshardable``), and its Adam step
counter, lost by ``sharded_state_dict``, is stored here and written back on load
(docs/cpu_stack.md, "Settings").
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ragen_mega.backends.megatron import lora
from ragen_mega.backends.megatron.parallel import local_device

STATE_FILE = "ragen_state.pt"
FORMAT_VERSION = 1
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
# TransformerConfig fields a checkpoint and its model must agree on (a mismatch names the field)
_SIGNATURE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "kv_channels", "normalization", "gated_linear_unit",
                     "add_bias_linear", "add_qkv_bias", "qk_layernorm", "layernorm_epsilon")
# ... and a mixture of experts' (in MoE models' signatures only)
_MOE_SIGNATURE_FIELDS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                         "moe_router_pre_softmax", "moe_shared_expert_intermediate_size",
                         "moe_shared_expert_gate")
# Files copied from the HF model directory so a checkpoint can be exported on its own.
_HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                  "tokenizer.model", "chat_template.jinja", "added_tokens.json")


@dataclasses.dataclass
class LoadedCheckpoint:
    step: int
    extra: dict
    path: Path


def _chunks(model) -> list:
    """The bare GPTModel chunks: Megatron DDP / Float16Module have no ``sharded_state_dict``."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(model) if isinstance(model, (list, tuple)) else [model])


def model_signature(model) -> dict:
    """The architecture of ``model`` (chunks) as plain values, e.g. ``{'hidden_size': 576, ...}``
    (``vocab_size``: the padded embedding's; ``role``: actor or critic). Two models load each
    other's checkpoints iff the signatures match."""
    first = _chunks(model)[0]
    fields = _SIGNATURE_FIELDS + (_MOE_SIGNATURE_FIELDS if first.config.num_moe_experts else ())
    sig = {f: getattr(first.config, f, None) for f in fields}
    sig["normalization"] = str(sig["normalization"])
    sig["vocab_size"] = getattr(first, "vocab_size", None)
    sig["share_embeddings_and_output_weights"] = bool(
        getattr(first, "share_embeddings_and_output_weights", False))
    sig["role"] = getattr(first, "ragen_role", None)
    settings = lora.settings_of(first)
    if settings is not None:  # absent for full weights
        sig["lora"] = settings.signature()
    return sig


def _model_sharded_state_dict(model) -> dict:
    # One sub-dict per virtual-pipeline chunk: keys inside a chunk are local layer names (they
    # would collide across chunks); ShardedTensor keys are global. LoRA: adapters only.
    return {f"chunk{i}": lora.sharded_state_dict(c) if lora.settings_of(c) else
            c.sharded_state_dict() for i, c in enumerate(_chunks(model))}


def _inner_optimizers(optimizer):
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield opt.optimizer  # the torch.optim.AdamW Megatron drives


def _optimizer_steps(optimizer) -> int:
    steps = [int(st["step"]) for opt in _inner_optimizers(optimizer)
             for st in opt.state.values() if "step" in st]
    n = torch.tensor(max(steps, default=0), dtype=torch.long, device=local_device())
    if dist.is_initialized():  # ranks whose shard holds no state still agree
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n)


def _set_optimizer_steps(optimizer, n: int) -> None:
    for opt in _inner_optimizers(optimizer):
        for st in opt.state.values():
            if "step" in st:
                st["step"] = torch.tensor(float(n)) if torch.is_tensor(st["step"]) else n


def _prime_adam_state(optimizer) -> None:
    """Give a never-stepped optimizer zero Adam state and a step counter.

    Megatron's DistributedOptimizer (without TE/Apex) builds its sharded state dict from the
    current state and asserts one common ``step``, which a never-stepped optimizer lacks. On
    load the loaded values overwrite the zeros; on save it lets a never-stepped optimizer (an
    actor in the critic's warm-up) be written, and zero moments at step 0 are where Adam starts."""
    for opt in _inner_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                state.setdefault("step", torch.tensor(0.0))


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def commit_dir(tmp: Path, final: Path) -> None:
    """Make the checkpoint visible: the one rename that makes a save complete."""
    os.rename(tmp, final)


_WRITERS: dict = {}  # this process's torch_dist writer set-up, once made


def writers_die_with_this_process() -> None:
    """Make every process this one forks from now on arm ``backends/parent_death.py``, so
    torch_dist's forked writers never outlive a killed trainer rank.

    Megatron passes the writers' results through a queue in a spawned ``multiprocessing``
    manager, for background saves. Ours are synchronous, so an in-process queue serves: no
    manager to start on the first save, nor to outlive its rank."""
    import queue
    from multiprocessing.util import register_after_fork

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from ragen_mega.backends.parent_death import die_with_parent

    if _WRITERS:
        return
    filesystem_async._results_queue = _WRITERS["queue"] = queue.Queue()
    parent = os.getpid()
    register_after_fork(writers_die_with_this_process, lambda _: die_with_parent(parent))


def save_checkpoint(root, step: int, model, optimizer=None, scheduler=None,
                    extra: dict | None = None, hf_dir=None) -> Path:
    """Write ``<root>/step_<step>`` atomically from every rank; return its path.

    ``extra`` (rank 0's): plain values only (ints, floats, str, None, lists, tuples, dicts,
    tensors), as ``torch.load(weights_only=True)`` refuses anything else on load. ``hf_dir``:
    the HF model directory whose config/tokenizer files are copied in.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    if int(step) < 0:
        raise ValueError(f"save_checkpoint: step must be >= 0, got {step}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"save_checkpoint: extra must be a dict, got {type(extra).__name__}")
    root = Path(root)
    final, tmp = root / f"step_{step}", root / f".tmp-step_{step}"
    if final.exists():
        raise FileExistsError(f"save_checkpoint: {final} already exists")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a killed save
        (tmp / "dist").mkdir(parents=True)
    _barrier()

    writers_die_with_this_process()
    model_sd = _model_sharded_state_dict(model)
    state = {"model": model_sd}
    if optimizer is not None:
        _prime_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, metadata=_OPTIMIZER_METADATA)
    dist_checkpointing.save(state, str(tmp / "dist"),
                            sharded_strategy=get_default_save_sharded_strategy("torch_dist"))
    opt_steps = _optimizer_steps(optimizer) if optimizer is not None else 0
    signature = model_signature(model)
    _barrier()
    error = None
    if _rank() == 0:
        try:
            state = {"format_version": FORMAT_VERSION, "step": int(step),
                     "optimizer_steps": opt_steps, "has_optimizer": optimizer is not None,
                     "scheduler": scheduler.state_dict() if scheduler is not None else None,
                     "signature": signature, "extra": extra or {}}
            if "lora" in signature and hf_dir is not None:  # where the base weights are
                state["lora_base"] = str(Path(hf_dir).resolve())
            torch.save(state, tmp / STATE_FILE)
            if hf_dir is not None:
                (tmp / "hf").mkdir()
                for name in _HF_SIDE_FILES:
                    if (Path(hf_dir) / name).exists():
                        shutil.copy2(Path(hf_dir) / name, tmp / "hf" / name)
            commit_dir(tmp, final)
        except Exception as err:  # noqa: BLE001 - re-raised below, after telling the others
            error = err
    # Every rank learns whether rank 0 committed, so none reports a save that did not happen.
    ok = torch.tensor(int(error is None), device=local_device())
    if dist.is_initialized():
        dist.broadcast(ok, src=0)
    if error is not None:
        raise error
    if not ok:
        raise RuntimeError(f"save_checkpoint: rank 0 failed to write {final}; "
                           f"{tmp} is incomplete")
    return final


def _check_signature(ckpt_dir: Path, saved: dict, current: dict) -> None:
    for field in sorted(set(saved) | set(current)):
        if saved.get(field) != current.get(field):
            raise ValueError(
                f"checkpoint {ckpt_dir} does not fit this model: field {field!r} is "
                f"{saved.get(field)!r} in the checkpoint but {current.get(field)!r} in the model")


class CorruptCheckpoint(ValueError):
    """A checkpoint directory with a missing, truncated or unreadable file (named)."""


class LegacyCheckpoint(RuntimeError):
    """A whole checkpoint whose state file holds pickled Python objects (classes, NumPy
    arrays), which ``weights_only`` loading refuses to execute. Not corrupt: resume stops on it
    rather than fall back to an older step (likely of the same format) and move this one aside."""


def read_checkpoint_state(ckpt_dir) -> dict:
    """The small rank-0 state of a complete checkpoint (step, signature, scheduler, extra),
    read with ``torch.load(weights_only=True)``: nothing in the file is executed. One holding
    pickled objects raises :class:`LegacyCheckpoint`."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / STATE_FILE
    if ckpt_dir.name.startswith(".tmp-"):
        raise FileNotFoundError(f"{ckpt_dir} is an unfinished or killed save, not a complete "
                                "checkpoint")
    if not path.exists():
        raise FileNotFoundError(f"{ckpt_dir} is not a complete ragen_mega checkpoint "
                                f"(no {STATE_FILE}); pass a step_N directory")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        try:  # what the file would execute, read without executing it
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001 - not even the pickle's opcodes read: a corrupt file
            raise e from None
        if not unsafe:
            raise
        raise LegacyCheckpoint(
            f"checkpoint {ckpt_dir}: {path} holds pickled Python objects "
            f"({', '.join(unsafe)}), which a safe load (torch.load weights_only=True) refuses "
            f"to execute: it was written by an older ragen_mega that pickled classes and NumPy "
            f"arrays into the checkpoint's state (the pending async rollout, NumPy's RNG "
            f"state). This version cannot read it: resume or convert it with the version "
            f"that wrote it, or start afresh (trainer.resume=never)") from None


def verify_checkpoint(ckpt_dir) -> None:
    """Check, without loading a tensor, that every file of a checkpoint is there and whole:
    the state file loads, and each shard file named by ``dist/.metadata`` exists and reaches the
    end of its last tensor. Raises :class:`CorruptCheckpoint` naming the first bad file (a full
    disk, a cut-short copy, a deleted shard), or :class:`LegacyCheckpoint`."""
    from torch.distributed.checkpoint import FileSystemReader

    ckpt_dir = Path(ckpt_dir)
    try:
        read_checkpoint_state(ckpt_dir)
    except (FileNotFoundError, LegacyCheckpoint):  # whole, but this version cannot read it
        raise
    except Exception as e:  # noqa: BLE001 - whatever a cut-off pickle raises
        raise CorruptCheckpoint(f"checkpoint {ckpt_dir}: {ckpt_dir / STATE_FILE} is unreadable "
                                f"({type(e).__name__}: {e})") from e
    dist_dir = ckpt_dir / "dist"
    for name in (".metadata", "common.pt", "metadata.json"):
        if not (dist_dir / name).is_file():
            raise CorruptCheckpoint(f"checkpoint {ckpt_dir}: {dist_dir / name} is missing")
    try:
        storage = FileSystemReader(str(dist_dir)).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpoint(f"checkpoint {ckpt_dir}: {dist_dir / '.metadata'} is unreadable "
                                f"({type(e).__name__}: {e})") from e
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    for name, end in sorted(needed.items()):
        shard = dist_dir / name
        if not shard.is_file():
            raise CorruptCheckpoint(f"checkpoint {ckpt_dir}: shard {shard} is missing")
        if shard.stat().st_size < end:
            raise CorruptCheckpoint(f"checkpoint {ckpt_dir}: shard {shard} is truncated "
                                    f"({shard.stat().st_size} bytes; its tensors end at {end})")


def load_checkpoint(ckpt_dir, model, optimizer=None, scheduler=None) -> LoadedCheckpoint:
    """Load into already-built ``model`` chunks (any TP x PP layout) and, if given, the optimizer
    and LR scheduler. Refuses a checkpoint of another architecture, naming the field, and an
    incomplete one, naming the file (:func:`verify_checkpoint`)."""
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    verify_checkpoint(ckpt_dir)
    meta = read_checkpoint_state(ckpt_dir)
    _check_signature(ckpt_dir, meta["signature"], model_signature(model))
    if optimizer is not None and not meta["has_optimizer"]:
        raise ValueError(f"checkpoint {ckpt_dir} holds no optimizer state (weights only); "
                         "load it with optimizer=None")

    writers_die_with_this_process()
    # A never-stepped optimizer's checkpoint (zero moments, no step: Megatron drops a step of 0)
    # is a fresh optimizer: start from one instead of loading it.
    never_stepped = optimizer is not None and meta["optimizer_steps"] == 0
    model_sd = _model_sharded_state_dict(model)
    state = {"model": model_sd}
    if optimizer is not None and not never_stepped:
        _prime_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                          metadata=_OPTIMIZER_METADATA)
    loaded = dist_checkpointing.load(state, str(ckpt_dir / "dist"))
    for i, chunk in enumerate(_chunks(model)):
        if lora.settings_of(chunk):
            lora.load_state_dict(chunk, loaded["model"][f"chunk{i}"])
        else:
            chunk.load_state_dict(loaded["model"][f"chunk{i}"])
    if never_stepped:
        for opt in _inner_optimizers(optimizer):
            opt.state.clear()
    elif optimizer is not None:
        with torch.no_grad():  # the distributed optimizer copies into views of leaf params
            optimizer.load_state_dict(loaded["optimizer"])
        _set_optimizer_steps(optimizer, meta["optimizer_steps"])
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    return LoadedCheckpoint(step=meta["step"], extra=meta["extra"], path=ckpt_dir)


def checkpoint_hf_dir(ckpt_dir) -> Path:
    """The ``hf/`` directory (config.json, tokenizer) stored inside a checkpoint."""
    hf = Path(ckpt_dir) / "hf"
    if not (hf / "config.json").exists():
        raise FileNotFoundError(f"checkpoint {ckpt_dir} carries no hf/config.json; "
                                "pass the original HF directory explicitly")
    return hf


def find_checkpoint(path) -> Path:
    """``path`` when it is a complete checkpoint (it holds ``ragen_state.pt``), else the newest
    complete ``step_N`` under it (a root: ``convert hf-to-megatron``'s ``--out-dir``, a run's
    ``checkpoints/actor``); FileNotFoundError naming what it looked for."""
    path = Path(path)
    if (path / STATE_FILE).exists():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"no complete ragen_mega checkpoint at or under {path} (a "
                                f"step_N directory holding {STATE_FILE} and a torch_dist dist/)")
    return found


def latest_checkpoint(root) -> Path | None:
    """The newest complete ``step_N`` under ``root``, or None (``.tmp-step_N`` never: the
    rename is the commit)."""
    root = Path(root)
    complete = [p for p in root.glob("step_*")
                if p.name[5:].isdigit() and (p / STATE_FILE).exists()]
    return max(complete, key=lambda p: int(p.name[5:]), default=None)
