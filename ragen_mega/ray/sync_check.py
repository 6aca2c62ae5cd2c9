"""After a weight sync: do the engines serve the trainer's weights? (slime's
check-weight-update-equal, ``trainer.check_weight_sync``)."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ragen_mega.ray.engine_group import EngineGroup
    from ragen_mega.ray.trainer_group import TrainerGroup

#: any fixed text will do: the probe compares two computations of the same completion
PROBE_PROMPT = "Count from one to ten: one, two, three,"


def max_logprob_diff(engines: EngineGroup, actor: TrainerGroup, tokenizer,
                     max_new_tokens: int = 8) -> float:
    """Max |engine - trainer| log-prob over a greedy completion of :data:`PROBE_PROMPT`, on every
    engine: near 0 iff every engine serves the trainer's weights."""
    prompt = tokenizer.encode(PROBE_PROMPT, add_special_tokens=False)
    sampling = {"temperature": 0.0, "max_new_tokens": max_new_tokens}

    async def ask_all():
        return await asyncio.gather(*(engines.generate(prompt, sampling, engine=i)
                                      for i in range(len(engines.urls))))

    worst = 0.0
    for gen in engines.run(ask_all()):
        ids = torch.tensor([prompt + gen.output_ids])
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "loss_mask": torch.zeros(ids.shape)}
        trainer = actor.compute_logprobs(batch)[0, len(prompt):]
        worst = max(worst, float((trainer - torch.tensor(gen.logprobs)).abs().max()))
    return worst
