"""An SGLang server plugin for CPU servers: host buffers without page-locking.

The routed-experts buffer of ``--enable-return-routed-experts`` is allocated through
``ALLOC_MEMORY_FUNCS[device]``, whose default registers it with CUDA for asynchronous device
copies and fails a CPU server's start-up; SGLang's LoRA serving (``--enable-lora``) stages
adapter weights and per-batch indices in page-locked tensors, which torch refuses without an
accelerator (docs/cpu_stack.md, "Plugins"). On the CPU all of it is host memory already: the
plugin gives the ``cpu`` device a plain ``torch.empty``, makes ``Tensor.pin_memory`` return the
tensor itself and drops ``pin_memory=True`` from torch's tensor factories.
"""
from __future__ import annotations

import functools

#: the factories SGLang calls with ``pin_memory=True``
PINNED_FACTORIES = ("tensor", "empty", "zeros", "ones", "full")


def unpinned_host_buffers_plugin() -> None:
    """SGLang general plugin: ``ALLOC_MEMORY_FUNCS["cpu"]`` allocates ordinary host memory, and
    no tensor asks to be page-locked."""
    import torch

    if torch.cuda.is_available():
        return
    from sglang.srt.mem_cache.pool_host import common

    def alloc_host(dims, dtype, device, pin_memory=False, allocator=None,
                   registration_granularity_bytes=None):
        return torch.empty(dims, dtype=dtype, device="cpu")

    common.ALLOC_MEMORY_FUNCS["cpu"] = alloc_host
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    for name in PINNED_FACTORIES:
        setattr(torch, name, _unpinned(getattr(torch, name)))


def _unpinned(factory):
    @functools.wraps(factory)
    def make(*args, pin_memory=False, **kwargs):
        return factory(*args, **kwargs)
    return make
