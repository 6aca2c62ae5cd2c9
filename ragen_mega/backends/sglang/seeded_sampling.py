"""Seeded sampling for CPU SGLang servers: a request that carries
``sampling_params["sampling_seed"]`` is sampled as a pure function of its logits, its seed and
the token position (SGLang's Gumbel-max ``multinomial_with_seed``), so it replays exactly
whatever else is in the batch; exact resume relies on it.

GPU servers get this from ``--enable-deterministic-inference``. On CPU that flag cannot start
(among other refusals, ``ModelRunner.maybe_enable_batch_invariant_mode`` raises in
``get_dispatch_device_backend``) and the seeded sampler's hash is a ``sgl_kernel`` op PyPI does
not ship, so CPU servers load :func:`seeded_sampling_plugin` (docs/cpu_stack.md, "Plugins").
"""
from __future__ import annotations

_U32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """``(x * c) mod 2**32`` for an int64 tensor ``x`` in [0, 2**32) and a 32-bit constant ``c``,
    in two 16-bit halves so no product leaves int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _U32


def _rotl32(x, r: int):
    return ((x << r) | (x >> (32 - r))) & _U32


def _murmur3_mix(h, k):
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    return (_rotl32(h ^ k, 13) * 5 + 0xE6546B64) & _U32


def murmur_hash32_torch(seed, positions, col_indices):
    """SGLang's ``murmur_hash32`` (MurmurHash3_x86_32, seed 0, of the 16 bytes seed_lo, seed_hi,
    position, column) in plain torch: [n] seeds and positions x [m] columns -> [n, m] values in
    [0, 2**32) (int64). It stands in for ``sgl_kernel.murmur_hash32_cpu``, which PyPI does not
    ship; the GPU Triton kernel computes the same function."""
    import torch

    seed = seed.to(torch.int64).view(-1, 1)
    h = torch.zeros_like(seed)
    for block in (seed & _U32, (seed >> 32) & _U32, positions.to(torch.int64).view(-1, 1) & _U32):
        h = _murmur3_mix(h, block)
    h = _murmur3_mix(h, col_indices.to(torch.int64).view(1, -1) & _U32) ^ 16
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def seeded_sampling_plugin() -> None:
    """SGLang general plugin: sample every request with SGLang's seeded Gumbel-max path, using its
    ``sampling_seed``, and :func:`murmur_hash32_torch` in place of the missing CPU op.

    Without ``--enable-deterministic-inference`` SGLang builds no seed tensor
    (``SamplingBatchInfo.from_schedule_batch``); this adds one to every batch (all rows:
    ``merge_batch`` concatenates it only when both sides have one). Rows without a seed get a
    fresh random one, so unseeded requests stay random; Gumbel-max over ``log p`` is an exact
    sample of ``p``, so the distribution is unchanged.
    """
    import random

    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    entropy = random.SystemRandom()

    def add_seeds(info, cls, batch, vocab_size):
        if info.sampling_seed is None:
            info.sampling_seed = torch.tensor(
                [entropy.getrandbits(63) if r.sampling_params.sampling_seed is None
                 else r.sampling_params.sampling_seed for r in batch.reqs],
                dtype=torch.int64, device=info.device)
        return info

    def hash_on_cpu(original, seed, positions, col_indices):
        if seed.device.type != "cpu":
            return original(seed, positions, col_indices)
        return murmur_hash32_torch(seed, positions, col_indices)

    HookRegistry.register(
        "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.from_schedule_batch",
        add_seeds, HookType.AFTER)
    HookRegistry.register("sglang.kernels.ops.sampling.murmur_hash.murmur_hash32", hash_on_cpu,
                          HookType.AROUND)
