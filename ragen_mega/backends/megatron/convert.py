"""Convert checkpoints between Hugging Face and Megatron (torch_dist) formats.

CLI::

    ragen-mega convert hf-to-megatron --hf-dir A --out-dir B [--tp N] [--pp M] [--ep E]
    ragen-mega convert megatron-to-hf --megatron-dir B --out-dir C [--hf-dir A] [--tp N] [--pp M]
                                      [--ep E]
    ragen-mega convert megatron-to-peft --megatron-dir B --out-dir C
    python -m ragen_mega.backends.megatron.convert hf-to-megatron ...

Both directions run one worker process per TP x PP x EP rank (``launch.run_workers``) and go
through the HF <-> Megatron mapping the weight sync uses (``models.mapping``). The Megatron side
is a weights-only checkpoint (``checkpoint.py``: torch_dist, loadable at any TP x PP x EP, with
a copy of config.json and the tokenizer), so the export's ``--tp/--pp/--ep`` only choose how
many processes share the work. The HF output (safetensors in the source config's dtype, vocab
padding removed; config.json; tokenizer files) is written to a temp dir and renamed into place.

A LoRA checkpoint (adapters only) goes to HF merged into its base model (the run's, or
``--hf-dir``), or, with ``megatron-to-peft``, to a PEFT adapter directory, without Megatron.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from ragen_mega.backends.megatron import checkpoint as ckpt
from ragen_mega.backends.megatron.launch import WorkerError, run_workers

SHARD_BYTES = 2 * 1024**3  # safetensors file size at which the HF export starts a new file
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.gguf", "model.safetensors.index.json",
                 "pytorch_model.bin.index.json")


def _threads(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def _check_layout(hf_dir: Path, tp: int, pp: int, ep: int) -> None:
    """Fail in the parent, before any process starts, on a layout the model cannot take."""
    from ragen_mega.models.hf_config import model_spec

    if not (hf_dir / "config.json").exists():
        raise FileNotFoundError(f"{hf_dir} has no config.json (not a Hugging Face model dir)")
    if tp < 1 or pp < 1 or ep < 1:
        raise ValueError(f"tp, pp and ep must be >= 1, got tp={tp}, pp={pp}, ep={ep}")
    model_spec(hf_dir).check_parallel(tp, pp, ep=ep)


def _progress(total: int, desc: str, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------------- HF -> Megatron
def _import_worker(rank, world_size, hf_dir, out_dir, role):
    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint

    chunks = build_model(hf_dir, role=role)
    bar = _progress(len(chunks) + 1, "hf -> megatron", "group") if rank == 0 else None
    for i, chunk in enumerate(chunks):  # one tensor group per pipeline chunk, then the save
        load_hf_checkpoint([chunk], hf_dir)
        if bar:
            bar.set_postfix_str(f"loaded chunk {i}")
            bar.update()
    path = ckpt.save_checkpoint(out_dir, 0, chunks, hf_dir=hf_dir)
    if bar:
        bar.set_postfix_str("saved torch_dist")
        bar.update()
        bar.close()
    return str(path)


def hf_to_megatron(hf_dir, out_dir, tp: int = 1, pp: int = 1, role: str = "actor",
                   ep: int = 1) -> Path:
    """Write the HF model at ``hf_dir`` as a Megatron checkpoint ``<out_dir>/step_0``."""
    hf_dir, out_dir = Path(hf_dir).resolve(), Path(out_dir).resolve()
    _check_layout(hf_dir, tp, pp, ep)
    if (out_dir / "step_0").exists():
        raise FileExistsError(f"{out_dir / 'step_0'} already exists")
    world = tp * pp * ep
    results = run_workers(_import_worker, world, str(hf_dir), str(out_dir), role, tp=tp, pp=pp,
                          ep=ep, timeout=24 * 3600, threads_per_worker=_threads(world))
    return Path(results[0])


# ---------------------------------------------------------------------- Megatron -> HF
def _target_dtype(hf_dir: Path) -> torch.dtype:
    from ragen_mega.models.hf_config import read_config_json

    config = read_config_json(hf_dir / "config.json")
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{hf_dir}/config.json: unknown dtype {name!r}")
    return dtype


class _ShardWriter:
    """Collects tensors into safetensors files of at most ``SHARD_BYTES``; HF index at the end."""

    def __init__(self, out_dir: Path, dtype: torch.dtype):
        self.out_dir, self.dtype = out_dir, dtype
        self.files: list[dict[str, torch.Tensor]] = [{}]
        self.size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to(self.dtype).contiguous().clone()
        nbytes = tensor.numel() * tensor.element_size()
        if self.files[-1] and self.size + nbytes > SHARD_BYTES:
            self._flush()
        self.files[-1][name] = tensor
        self.size += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        index = len(self.files)
        save_file(self.files[-1], str(self.out_dir / f"part-{index:05d}.safetensors"),
                  metadata={"format": "pt"})
        self.files[-1] = {name: None for name in self.files[-1]}  # keep names, drop tensors
        self.files.append({})
        self.size = 0

    def close(self) -> None:
        self._flush()
        names = [f for f in self.files if f]
        if len(names) == 1:
            os.rename(self.out_dir / "part-00001.safetensors", self.out_dir / "model.safetensors")
            return
        weight_map, total = {}, len(names)
        for i, file_names in enumerate(names, start=1):
            final = f"model-{i:05d}-of-{total:05d}.safetensors"
            os.rename(self.out_dir / f"part-{i:05d}.safetensors", self.out_dir / final)
            weight_map.update({n: final for n in file_names})
        (self.out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def _export_worker(rank, world_size, ckpt_dir, src_hf, tmp_out, role, lora_settings=None):
    from ragen_mega.backends.megatron.export import export_hf_state
    from ragen_mega.backends.megatron.lora import apply_lora
    from ragen_mega.backends.megatron.model import build_model, chunk_spec, load_hf_checkpoint
    from ragen_mega.models.mapping import expected_hf_shapes

    chunks = build_model(src_hf, role=role, use_te=False if lora_settings else None)
    if lora_settings is not None:  # the base from src_hf, the adapters from the checkpoint
        load_hf_checkpoint(chunks, src_hf)
        apply_lora(chunks, lora_settings, seed=0)
    ckpt.load_checkpoint(ckpt_dir, chunks)
    spec, _ = chunk_spec(chunks)
    writer = _ShardWriter(Path(tmp_out), _target_dtype(Path(src_hf))) if rank == 0 else None
    bar = (_progress(len(expected_hf_shapes(spec, role)), "megatron -> hf", "tensor")
           if rank == 0 else None)
    for name, tensor in export_hf_state(chunks):  # collective: every rank iterates
        if writer:
            writer.add(name, tensor)
            bar.update()
    if writer:
        writer.close()
        bar.close()
    return None


def _lora_settings(state: dict):
    """A LoRA checkpoint's ``LoraSettings`` (dropout 0: unused in an export), or None."""
    from ragen_mega.backends.megatron.lora import LoraSettings

    sig = state["signature"].get("lora")
    if sig is None:
        return None
    return LoraSettings(int(sig["rank"]), float(sig["alpha"]), 0.0,
                        tuple(sig["target_modules"]))


def _lora_base(ckpt_dir: Path, state: dict, hf_dir) -> Path:
    """The base model (with weights) of a LoRA checkpoint: ``hf_dir``, else the run's."""
    base = Path(hf_dir).resolve() if hf_dir else Path(state.get("lora_base", ""))
    if not hf_dir and not state.get("lora_base"):
        raise ValueError(f"{ckpt_dir} holds LoRA adapters only and does not say its base "
                         "model: pass --hf-dir BASE (the model.path it trained from)")
    if not any(base.glob("*.safetensors")):
        raise FileNotFoundError(f"{ckpt_dir} holds LoRA adapters only; their base model {base} "
                                "has no *.safetensors weights (pass --hf-dir BASE)")
    return base


@contextlib.contextmanager
def _written_into_place(out_dir: Path):
    """A temp twin of ``out_dir`` (absent or empty) to write the output into, renamed into place
    when the block ends without an error, removed in any case."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    tmp = out_dir.parent / f".tmp-{out_dir.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def megatron_to_hf(megatron_dir, out_dir, hf_dir=None, tp: int = 1, pp: int = 1,
                   ep: int = 1) -> Path:
    """Write a Megatron checkpoint (a ``step_N`` dir, or the newest under a root) as an HF dir.

    ``hf_dir`` supplies config.json and the tokenizer (default: the checkpoint's copy). A LoRA
    checkpoint is merged into its base (:func:`_lora_base`): ``W_base + s * B A``.
    """
    ckpt_dir = ckpt.find_checkpoint(Path(megatron_dir).resolve())
    if hf_dir:  # the user's config is checked before the checkpoint is opened
        _check_layout(Path(hf_dir).resolve(), tp, pp, ep)
    state = ckpt.read_checkpoint_state(ckpt_dir)
    lora = _lora_settings(state)
    if lora is not None:
        src_hf = _lora_base(ckpt_dir, state, hf_dir)
    else:
        src_hf = Path(hf_dir).resolve() if hf_dir else ckpt.checkpoint_hf_dir(ckpt_dir)
    if not hf_dir:
        _check_layout(src_hf, tp, pp, ep)
    role = state["signature"].get("role") or "actor"
    out_dir = Path(out_dir).resolve()
    with _written_into_place(out_dir) as tmp:
        world = tp * pp * ep
        run_workers(_export_worker, world, str(ckpt_dir), str(src_hf), str(tmp), role, lora,
                    tp=tp, pp=pp, ep=ep, timeout=24 * 3600, threads_per_worker=_threads(world))
        for item in src_hf.iterdir():  # config, generation config, tokenizer, chat template
            if item.is_file() and not any(item.match(p) for p in _WEIGHT_FILES):
                shutil.copy2(item, tmp / item.name)
    return out_dir


def read_adapters(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's adapters, whole, read without model or process group (torch_dist
    stores each under its HF name and whole shape)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    reader = FileSystemReader(str(ckpt_dir / "dist"))
    meta = reader.read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
               if k.endswith((".lora_A.weight", ".lora_B.weight"))
               and not k.startswith("optimizer.")}
    dcp_load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def megatron_to_peft(megatron_dir, out_dir) -> Path:
    """Write a LoRA checkpoint's adapters as a PEFT adapter directory
    (:func:`lora_export.write_peft_adapter`)."""
    from ragen_mega.backends.megatron.lora_export import write_peft_adapter

    ckpt_dir = ckpt.find_checkpoint(Path(megatron_dir).resolve())
    state = ckpt.read_checkpoint_state(ckpt_dir)
    lora = _lora_settings(state)
    if lora is None:
        raise ValueError(f"{ckpt_dir} holds full weights, not LoRA adapters: export it with "
                         "megatron-to-hf")
    if state["signature"].get("role") == "critic":
        raise ValueError(f"{ckpt_dir} is a critic's: its value head is no PEFT adapter; export "
                         "it merged with megatron-to-hf")
    out_dir = Path(out_dir).resolve()
    with _written_into_place(out_dir) as tmp:
        write_peft_adapter(tmp, read_adapters(ckpt_dir), lora, state.get("lora_base", ""))
    return out_dir


# ---------------------------------------------------------------------- CLI
def build_parser(prog: str = "ragen-mega convert") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Convert between Hugging Face and "
                                     "Megatron (torch_dist) checkpoints.")
    sub = parser.add_subparsers(dest="direction", required=True)
    imp = sub.add_parser("hf-to-megatron", help="HF model dir -> <out-dir>/step_0")
    imp.add_argument("--hf-dir", required=True)
    imp.add_argument("--out-dir", required=True)
    imp.add_argument("--tp", type=int, default=1, help="tensor parallel size of the save")
    imp.add_argument("--pp", type=int, default=1, help="pipeline parallel size of the save")
    imp.add_argument("--ep", type=int, default=1,
                     help="expert parallel size of the save (mixtures of experts)")
    exp = sub.add_parser("megatron-to-hf", help="Megatron checkpoint -> HF model dir")
    exp.add_argument("--megatron-dir", required=True,
                     help="a step_N checkpoint dir, or a root (its newest complete checkpoint)")
    exp.add_argument("--out-dir", required=True)
    exp.add_argument("--hf-dir", default=None,
                     help="config/tokenizer source (default: the copy inside the checkpoint)")
    exp.add_argument("--tp", type=int, default=1, help="processes sharing the export (TP)")
    exp.add_argument("--pp", type=int, default=1, help="processes sharing the export (PP)")
    exp.add_argument("--ep", type=int, default=1,
                     help="processes sharing the experts of the export (EP)")
    peft = sub.add_parser("megatron-to-peft",
                          help="a LoRA checkpoint's adapters -> PEFT adapter dir")
    peft.add_argument("--megatron-dir", required=True,
                      help="a step_N checkpoint dir, or a root (its newest complete checkpoint)")
    peft.add_argument("--out-dir", required=True)
    return parser


def main(argv=None) -> int:
    """Entry point; returns a process exit code (errors: a one-line message, exit code 1)."""
    args = build_parser().parse_args(argv)
    try:
        if args.direction == "hf-to-megatron":
            path = hf_to_megatron(args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp,
                                  ep=args.ep)
        elif args.direction == "megatron-to-peft":
            path = megatron_to_peft(args.megatron_dir, args.out_dir)
        else:
            path = megatron_to_hf(args.megatron_dir, args.out_dir, hf_dir=args.hf_dir,
                                  tp=args.tp, pp=args.pp, ep=args.ep)
    except (OSError, ValueError, KeyError, WorkerError) as err:
        print(f"ragen-mega convert: error: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
