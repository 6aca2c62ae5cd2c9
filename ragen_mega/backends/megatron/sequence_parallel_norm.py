"""The RMSNorm of Megatron's local layer spec, for sequence parallelism (a mixture of experts
under TP).

Without TransformerEngine or Apex, megatron-core's local spec builds torch's ``RMSNorm``
(``WrappedTorchNorm``), which refuses ``sequence_parallel``: each TP rank then normalises its
slice of the sequence, so a norm weight's gradient must be summed over the TP ranks, which
megatron-core does only for parameters marked ``sequence_parallel``. This is torch's
``RMSNorm``, marked; the q/k norms get it too (megatron-core sums them by name anyway).
(docs/design.md, "Mixtures of experts")
"""
from __future__ import annotations

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's ``RMSNorm`` built as megatron-core builds norms, its weight marked
    ``sequence_parallel`` when the config runs it."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(normalized_shape=hidden_size, eps=eps)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)
