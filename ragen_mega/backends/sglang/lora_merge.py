"""An SGLang server plugin: LoRA adapters in, exact merged weights served (``actor.lora``).

A LoRA run's weight sync sends only the adapters (``lora.AdapterExport``: a few MB where the
model is GB). The engine keeps serving plain merged weights, so generation runs at full speed
with no LoRA kernel (SGLang's LoRA backends are Triton/CUDA, or per-request adapter slots that
every rollout request would have to name): this plugin, enabled for a server by
:data:`TARGETS_ENV` (the adapted HF module names, comma separated), merges on the engine's side.

* At the initial load (and a reload from disk) it keeps a host copy of the base weight of every
  adapted module as it streams past (``model.layers.3.self_attn.q_proj.weight``): each engine
  rank holds the adapted modules' base weights whole, a second copy of them in host memory.
* Every later ``load_weights`` (a sync through either transport) reads the run's scaling
  (:data:`SCALING_NAME`, a one-value tensor sent first) and the adapters under PEFT's keys
  (``model.layers.3.self_attn.q_proj.lora_A.weight``, ``...lora_B.weight``); once a module's A
  and B are both in, the model is given ``W = W_base + s * B A``, computed in fp32 from the kept
  base and cast to its dtype. Every sync starts from the base, so nothing accumulates or
  drifts, and it is the trainer's own merge (``lora.LoraLinear.merged``) on the whole matrix.
  Other names pass through unchanged (a full sync still works).

A restarted engine loads the base from disk, keeps it again, and takes the current adapters
from the resync that follows, as every restarted engine takes the current weights.
"""
from __future__ import annotations

import logging
import os
import re

import torch

logger = logging.getLogger(__name__)

TARGETS_ENV = "RAGEN_MEGA_LORA_TARGETS"
#: the one-value tensor that carries alpha / rank, sent ahead of the adapters
SCALING_NAME = "ragen_mega.lora_scaling"
_ADAPTER = re.compile(r"^(.*)\.lora_([AB])\.weight$")
_TARGET = "sglang.srt.model_loader.loader.DefaultModelLoader.load_weights_and_postprocess"


class AdapterMerger:
    """One server process's base copies, scaling and adapters waiting for their other half."""

    def __init__(self, targets: set[str]):
        self.targets, self.base, self.scaling = targets, {}, None
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def adapted(self, name: str) -> str | None:
        """The module of a base weight this plugin keeps (``...q_proj``), else None."""
        if not name.endswith(".weight"):
            return None
        module = name[: -len(".weight")]
        return module if module.rsplit(".", 1)[-1] in self.targets else None

    def keep_base(self, weights):
        """``weights`` unchanged, a copy of each adapted module's base weight kept."""
        for name, tensor in weights:
            module = self.adapted(name)
            if module is not None:
                self.base[module] = tensor.detach().to("cpu", copy=True)
            yield name, tensor

    def merge(self, weights):
        """``weights`` with the scaling and adapters replaced by merged module weights."""
        for name, tensor in weights:
            if name == SCALING_NAME:
                self.scaling = float(tensor.reshape(-1)[0])
                continue
            match = _ADAPTER.match(name)
            if match is None:
                yield name, tensor
                continue
            module, half = match.groups()
            parts = self.pending.setdefault(module, {})
            parts[half] = tensor.detach().to("cpu", torch.float32, copy=True)  # the receive
            if len(parts) < 2:                                # buffer is reused after the load
                continue
            del self.pending[module]
            yield f"{module}.weight", self.merged(module, parts["A"], parts["B"])

    def merged(self, module: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.scaling is None:
            raise ValueError(f"lora_merge: adapters of {module} arrived before "
                             f"{SCALING_NAME}, which every adapter sync sends first")
        base = self.base.get(module)
        if base is None:
            raise KeyError(f"lora_merge: no base weight of {module} was kept (the server was "
                           f"told to adapt {sorted(self.targets)}; the trainer's "
                           "actor.lora.target_modules must be the same)")
        return (base.float() + self.scaling * (b @ a)).to(base.dtype)


def lora_merge_plugin() -> None:
    """SGLang general plugin: see the module docstring; does nothing without
    :data:`TARGETS_ENV`."""
    targets = {t for t in os.environ.get(TARGETS_ENV, "").split(",") if t}
    if not targets:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    merger = AdapterMerger(targets)

    def load_and_keep(original, model, weights, target_device):
        result = original(model, merger.keep_base(weights), target_device)
        if not getattr(model, "_ragen_mega_lora_merge", False):
            load = model.load_weights
            model.load_weights = lambda named: load(merger.merge(named))
            model._ragen_mega_lora_merge = True
        logger.info("lora_merge: base weights of %d adapted modules kept", len(merger.base))
        return result

    HookRegistry.register(_TARGET, load_and_keep, HookType.AROUND)
