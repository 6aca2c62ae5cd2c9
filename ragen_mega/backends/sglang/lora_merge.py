"""An SGLang server plugin: LoRA adapters in, exact merged weights served (``actor.lora``).

A LoRA run's sync sends only the adapters (``lora_export.AdapterExport``) and the engine serves
plain merged weights with no LoRA kernel (SGLang's LoRA backends are Triton/CUDA, or per-request
adapter slots every rollout request would have to name); why, and the cost: docs/design.md,
"LoRA". Enabled by :data:`TARGETS_ENV` (the adapted HF module names, comma separated):

* After the initial load (or a reload from disk) it keeps a host copy of every parameter an
  adapted module loads into (``q_proj`` into the fused ``qkv_proj.weight``, an expert's
  ``gate_proj`` into ``experts.w13_weight``) as this rank holds it (its TP shard, its EP
  experts), taken before SGLang's post-load processing: the layout a weight update writes.
* Every later ``load_weights`` (either transport) reads the scaling (:data:`SCALING_NAME`, sent
  first) and the adapters under PEFT's keys (``...q_proj.lora_A.weight``, ``...lora_B.weight``).
  Once a module's A and B are in, ``s * B A`` (fp32, whole matrix) goes through the model's own
  weight loader into an fp32 scratch swapped in for the parameter; NaN-filled at the first sync,
  the scratch shows which rows the loader wrote (the module's shard), and they are remembered.
  Those rows become ``W_base + s B A`` from the kept base, cast once to the parameter's dtype, so
  nothing drifts and each entry is the trainer's own merge (``lora.LoraLinear.merged``). Other
  names pass through (a full sync still works). The model's ``load_weights`` must load each
  weight as it draws it, as SGLang's Qwen2, Qwen3, Llama and Qwen2/Qwen3-MoE do.

A restarted engine keeps the base it loads from disk and gets the adapters from the resync.
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
_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(gate_proj|up_proj|down_proj)$")
#: HF linears SGLang's dense models load into one fused parameter (their stacked_params_mapping)
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
_TARGET = "sglang.srt.model_loader.loader.DefaultModelLoader.load_weights_only"


def parameter_of(module: str) -> str:
    """The SGLang parameter an HF module's weight loads into (``...qkv_proj.weight`` for
    ``...q_proj``; an expert's linears into their layer's ``experts.w13_weight`` and
    ``experts.w2_weight``)."""
    expert = _EXPERT.match(module)
    if expert is not None:
        kind = "w2_weight" if expert[2] == "down_proj" else "w13_weight"
        return f"{expert[1]}.{kind}"
    parent, _, leaf = module.rpartition(".")
    fused = _FUSED.get(leaf, leaf)
    return f"{parent}.{fused}.weight" if parent else f"{fused}.weight"


class AdapterMerger:
    """One server process's base copies, scaling and adapters waiting for their other half."""

    def __init__(self, targets: set[str]):
        self.targets, self.base, self.scaling = targets, {}, None
        self.modules: set[str] = set()
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        #: each module's rows in its parameter (as rows x last dim), None where not this rank's
        self.blocks: dict[str, slice | None] = {}
        self._swapped: tuple[torch.nn.Parameter, torch.Tensor, str, str] | None = None
        #: the fp32 scratch of one load_weights call, reused parameter after parameter
        self._buffer: torch.Tensor | None = None

    def adapted(self, name: str) -> str | None:
        """The module of a base weight this plugin adapts (``...q_proj``), else None."""
        if not name.endswith(".weight"):
            return None
        module = name[: -len(".weight")]
        return module if module.rsplit(".", 1)[-1] in self.targets else None

    def note_adapted(self, weights):
        """``weights`` unchanged, the adapted modules among them noted."""
        for name, tensor in weights:
            module = self.adapted(name)
            if module is not None:
                self.modules.add(module)
            yield name, tensor

    def keep_base(self, model: torch.nn.Module) -> None:
        """A host copy of each parameter the noted modules loaded into, as it is now."""
        params = dict(model.named_parameters())
        self.base = {}
        for module in sorted(self.modules):
            name = self._parameter(params, module, model)
            if name not in self.base:
                self.base[name] = params[name].detach().to("cpu", copy=True)
        size = sum(t.numel() * t.element_size() for t in self.base.values())
        logger.info("lora_merge: base weights of %d adapted modules kept: %d parameters, "
                    "%.3f MiB (this rank's shards)", len(self.modules), len(self.base),
                    size / 2**20)

    @staticmethod
    def _parameter(params: dict, module: str, model: torch.nn.Module) -> str:
        name = parameter_of(module)
        if name not in params:
            raise KeyError(f"lora_merge: {type(model).__name__} has no parameter {name} for the "
                           f"adapted module {module}")
        return name

    def merge(self, weights, model: torch.nn.Module):
        """``weights`` with the scaling and adapters replaced by their products ``s B A``,
        each loaded into a scratch and merged onto the base once the loader is done with it
        (when the loader asks for the next weight, or :meth:`finish`)."""
        params = dict(model.named_parameters())
        for name, tensor in weights:
            self.finish()
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
            delta = self.delta(module, parts["A"], parts["B"])
            self._swap_in(params, self._parameter(params, module, model), module)
            yield f"{module}.weight", delta
        self.finish()

    def delta(self, module: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.scaling is None:
            raise ValueError(f"lora_merge: adapters of {module} arrived before "
                             f"{SCALING_NAME}, which every adapter sync sends first")
        return self.scaling * (b @ a)

    def _swap_in(self, params: dict, name: str, module: str) -> None:
        """An fp32 scratch under parameter ``name`` for the load of ``module``'s ``s B A``."""
        if name not in self.base:
            raise KeyError(f"lora_merge: no base weight of {module} was kept (the server was "
                           f"told to adapt {sorted(self.targets)}; the trainer's "
                           "actor.lora.target_modules must be the same)")
        param = params[name]
        served = param.data
        if self._buffer is None or self._buffer.numel() < served.numel():
            self._buffer = torch.empty(served.numel(), dtype=torch.float32, device=served.device)
        scratch = self._buffer[: served.numel()].view(served.shape)
        if module not in self.blocks:
            scratch.fill_(float("nan"))
        param.data = scratch
        self._swapped = (param, served, module, name)

    def release(self) -> None:
        """The end of a load: no scratch left swapped in, the scratch buffer freed."""
        self.finish()
        self._buffer = None

    def finish(self) -> None:
        """Put the served tensor back under the swapped parameter, the rows the loader wrote
        into the scratch set to ``base + s B A``; the rest as they were."""
        if self._swapped is None:
            return
        param, served, module, name = self._swapped
        self._swapped = None
        scratch, param.data = param.data, served
        shape = (-1, scratch.shape[-1])
        if module not in self.blocks:
            self.blocks[module] = self._written_block(scratch.view(shape), module, name)
        block = self.blocks[module]
        if block is None:
            return                                  # not this rank's (another EP rank's expert)
        # added in fp32 (the scratch's dtype), rounded once into the served dtype
        torch.add(self.base[name].view(shape)[block].to(served.device),
                  scratch.view(shape)[block], out=served.view(shape)[block])

    @staticmethod
    def _written_block(scratch: torch.Tensor, module: str, name: str) -> slice | None:
        """The rows of a NaN-filled scratch the loader wrote, as one block. SGLang's loaders
        write a module's shard as whole rows of its parameter seen as (rows, last dim): a fused
        linear's part, an expert's block, the LM head's rows and padding. The same load writes
        the same rows every sync, so this runs at the first only (a NaN fill and a mask over
        every entry would make every sync several times slower)."""
        rows = (~scratch[:, 0].isnan()).nonzero()
        if not len(rows):
            return None
        block = slice(int(rows[0]), int(rows[-1]) + 1)
        if len(rows) != block.stop - block.start or scratch[block].sum().isnan():
            raise RuntimeError(f"lora_merge: {name} holds NaN after loading {module}'s "
                               "s * B A: NaN adapters, or a loader that writes other than one "
                               "block of whole rows (all this plugin merges)")
        return block


def lora_merge_plugin() -> None:
    """SGLang general plugin: see the module docstring; does nothing without
    :data:`TARGETS_ENV`."""
    targets = {t for t in os.environ.get(TARGETS_ENV, "").split(",") if t}
    if not targets:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    merger = AdapterMerger(targets)

    def load_and_keep(original, model, weights, target_device):
        result = original(model, merger.note_adapted(weights), target_device)
        merger.keep_base(model)
        if not getattr(model, "_ragen_mega_lora_merge", False):
            load = model.load_weights

            def load_merged(named):
                try:
                    return load(merger.merge(named, model))
                finally:
                    merger.release()   # also where the loader stopped early

            model.load_weights = load_merged
            model._ragen_mega_lora_merge = True
        return result

    HookRegistry.register(_TARGET, load_and_keep, HookType.AROUND)
