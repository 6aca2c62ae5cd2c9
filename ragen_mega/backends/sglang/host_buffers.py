"""An SGLang server plugin for CPU servers: host buffers without page-locking.

SGLang allocates some host-side buffers through ``ALLOC_MEMORY_FUNCS[device]``
(``mem_cache/pool_host/common.py``), whose default registers the memory with CUDA
(``cudaHostRegister``) so that device copies into it can be asynchronous. A CPU server has no
CUDA, so the first such buffer fails the start-up: the one that ``--enable-return-routed-experts``
makes for the experts each token was routed to (``state_capturer/base.py``, ``BaseHostCache``),
which routing replay needs. On the CPU every buffer is host memory already: the plugin gives
the ``cpu`` device a plain ``torch.empty``.
"""
from __future__ import annotations


def unpinned_host_buffers_plugin() -> None:
    """SGLang general plugin: ``ALLOC_MEMORY_FUNCS["cpu"]`` allocates ordinary host memory."""
    import torch

    if torch.cuda.is_available():
        return
    from sglang.srt.mem_cache.pool_host import common

    def alloc_host(dims, dtype, device, pin_memory=False, allocator=None,
                   registration_granularity_bytes=None):
        return torch.empty(dims, dtype=dtype, device="cpu")

    common.ALLOC_MEMORY_FUNCS["cpu"] = alloc_host
