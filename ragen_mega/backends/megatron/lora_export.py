"""LoRA adapters out of the sharded model, whole: gathered, as PEFT files, as the weight sync.

The adapters (``lora.py``) live sliced over TP and spread over PP and EP ranks; everything
outside the trainer wants them whole under PEFT's names. :func:`write_peft_adapter` writes the
adapter directory that ``peft.PeftModel.from_pretrained`` and SGLang's ``--enable-lora`` load
(``convert megatron-to-peft``, ``lora.sync: native``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist

from ragen_mega.backends.megatron.chunk import unwrap
from ragen_mega.backends.megatron.lora import LoraSettings, adapter_tensors, settings_of


def gather_adapters(chunks) -> dict[str, torch.Tensor]:
    """Every adapter of the whole model as whole tensors, on every rank (collective over the
    TP, EP and PP groups; small: rank x (in + out) values per linear)."""
    from megatron.core import parallel_state as mpu

    tp, tp_group = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_group()
    mine = {}
    for model in map(unwrap, chunks):
        for key, param, axis in adapter_tensors(model):
            tensor = param.detach().clone()   # a copy: never a view of the live parameter
            if axis is not None and tp > 1:
                parts = [torch.empty_like(tensor) for _ in range(tp)]
                dist.all_gather(parts, tensor, group=tp_group)
                tensor = torch.cat(parts, dim=axis)
            mine[key] = tensor.cpu()
    if mpu.get_expert_model_parallel_world_size() > 1:   # each holds its own experts'
        ranks = [None] * mpu.get_expert_model_parallel_world_size()
        dist.all_gather_object(ranks, mine, group=mpu.get_expert_model_parallel_group())
        mine = {k: v for rank in ranks for k, v in rank.items()}
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return mine
    stages = [None] * mpu.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, mine, group=mpu.get_pipeline_model_parallel_group())
    return {k: v for stage in stages for k, v in stage.items()}


PEFT_PREFIX = "base_model.model."


def write_peft_adapter(out_dir, tensors: dict[str, torch.Tensor], settings: LoraSettings,
                       base_model: str, dtype: torch.dtype | None = None) -> None:
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) that
    ``peft.PeftModel.from_pretrained(base, out_dir)`` loads onto the HF base model."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({PEFT_PREFIX + k: (v.to(dtype) if dtype else v).contiguous()
               for k, v in tensors.items()}, str(out_dir / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
              "target_modules": sorted(settings.target_modules), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "modules_to_save": None, "inference_mode": True}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


class AdapterExport:
    """The adapter-only weight sync's export, in ``export.DirectExport``'s protocol: constructing
    it is the collective (:func:`gather_adapters`, every rank); iterating yields, on ``dst``
    only, the scaling (``lora_merge.SCALING_NAME``, one fp32 value), then each module's A and B
    under PEFT's keys, which the engine's ``lora_merge`` plugin merges; ``layout`` (on ``dst``)
    lists their names, shapes and dtypes for the streamed send (docs/design.md, "LoRA")."""

    def __init__(self, chunks, dst: int):
        from ragen_mega.backends.sglang.lora_merge import SCALING_NAME

        tensors = gather_adapters(chunks)
        self.items = None
        self.layout = None
        if dist.get_rank() != dst:
            return
        scaling = torch.tensor([settings_of(chunks[0]).scaling], dtype=torch.float32)
        self.items = [(SCALING_NAME, scaling), *sorted(tensors.items(), key=_module_order)]
        self.layout = [(n, tuple(t.shape), t.dtype) for n, t in self.items]

    def __iter__(self):
        return iter(self.items or ())


def _module_order(item) -> tuple:
    """Layers in order, each module's lora_A before its lora_B."""
    name = item[0]
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return (int(match.group(1)) if match else 1 << 30, name)
