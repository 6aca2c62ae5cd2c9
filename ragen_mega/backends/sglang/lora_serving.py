"""SGLang's own LoRA serving for a LoRA run's engines (``actor.lora.sync: native``;
``--enable-lora``: S-LoRA-style kernels on a GPU, the ``torch_native`` backend on a CPU).

Each sync writes the adapters as a PEFT directory under the run directory (the engines must be
able to read it) and every engine loads it as ``ragen_mega_v{version}``; requests name the newest
version (``EngineGroup.adapter``); each engine keeps the newest two (an overlapped rollout may
still play the older one). Against the default merge (``lora_merge.py``): no host copy of the
base, no update pause, a sync of a few MB, but the adapters' matmuls in every request. The merge
stays the default: this path has run on CPU engines only, and the two have not been compared on
a GPU. How it works: docs/design.md, "LoRA".
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ADAPTER_PREFIX = "ragen_mega_v"
#: versions an engine serves at once: the newest, and the one a rollout may still be playing
KEPT_VERSIONS = 2


def adapter_name(version: int) -> str:
    return f"{ADAPTER_PREFIX}{version}"


def server_args(rank: int, target_modules, device: str) -> list[str]:
    """The SGLang flags of a server that serves the run's adapters by name."""
    args = ["--enable-lora", "--max-lora-rank", str(rank),
            "--lora-target-modules", *target_modules,
            "--max-loras-per-batch", str(KEPT_VERSIONS)]
    if device == "cpu":   # SGLang's other LoRA backends are Triton/CUDA kernels
        args += ["--lora-backend", "torch_native"]
    return args


@dataclass
class PublishStats:
    seconds: float
    num_bytes: int


class ServedAdapters:
    """The sending trainer rank's side: writes each version's adapters and has every engine
    (``clients``: ``EngineClient``s) serve it. ``loaded[i]``: the versions engine ``i`` serves,
    oldest first."""

    def __init__(self, clients, adapter_dir: str | Path, base_model: str):
        self.clients, self.dir, self.base_model = list(clients), Path(adapter_dir), base_model
        self.loaded: list[list[str]] = [[] for _ in self.clients]

    def replace_engines(self, new: dict) -> None:
        """Engines restarted (index -> client): they serve no adapter yet."""
        for i, client in new.items():
            self.clients[i].close()
            self.clients[i], self.loaded[i] = client, []

    def publish(self, tensors: dict[str, torch.Tensor], settings, version: int) -> PublishStats:
        """Write ``tensors`` (``lora_export.gather_adapters``') as version ``version`` and have
        every engine that lacks it load it; then each unloads what is older than the newest
        :data:`KEPT_VERSIONS`."""
        from ragen_mega.backends.megatron.lora_export import write_peft_adapter

        start = time.perf_counter()
        name = adapter_name(version)
        path = self.dir / name
        if not all(name in loaded for loaded in self.loaded):
            staging = self.dir / f".{name}.partial"   # complete before the engines see it
            shutil.rmtree(staging, ignore_errors=True)
            write_peft_adapter(staging, tensors, settings, self.base_model)
            shutil.rmtree(path, ignore_errors=True)
            staging.rename(path)
        for client, loaded in zip(self.clients, self.loaded):
            if name not in loaded:
                client.load_lora_adapter(name, path)
                loaded.append(name)
            while len(loaded) > KEPT_VERSIONS:
                client.unload_lora_adapter(loaded.pop(0))
        self._remove_unserved()
        return PublishStats(time.perf_counter() - start,
                            (path / "adapter_model.safetensors").stat().st_size)

    def _remove_unserved(self) -> None:
        served = {name for loaded in self.loaded for name in loaded}
        for old in self.dir.glob(f"{ADAPTER_PREFIX}*"):
            if old.name not in served:
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        for client in self.clients:
            client.close()
