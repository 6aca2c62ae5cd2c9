"""The CPU engines' weight-sync receive (``backends/sglang/warm_receive.py``), on a real gloo pair.

Rank 0 broadcasts three rounds of tensors of mixed dtypes; rank 1 receives them the way the
plugin does inside an SGLang server. Checked: the values arrive bit for bit, views are 64-byte
aligned and reused from round to round (the point: warm memory), and a model that kept a received
tensor as its parameter takes the arena with it, so the next round lands in new memory and the
kept weight is not overwritten. The plugin's wiring into a real server is checked by
test_weight_sync_megatron.py (the server logs the arena it allocates).
"""
from __future__ import annotations

import torch

from ragen_mega.backends.megatron.launch import run_workers

NAMES = ["a", "b", "c", "empty"]
DTYPES = ["float32", torch.bfloat16, "int64", torch.float32]  # SGLang passes names or dtypes
SHAPES = [[3, 5], [7], [2, 2], [0, 4]]


def _expected(step: int) -> list[torch.Tensor]:
    out = []
    for dtype, shape in zip(DTYPES, SHAPES):
        dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
        n = torch.Size(shape).numel()
        out.append((torch.arange(n) * (step + 1) + 100 * step).to(dtype).view(shape))
    return out


def _arena_worker(rank, world_size):
    import torch.distributed as dist
    from torch import nn

    from ragen_mega.backends.sglang import warm_receive

    report = []
    for step in range(3):
        if rank == 0:
            for tensor in _expected(step):
                dist.broadcast(tensor, src=0)
            continue
        got = warm_receive.receive_into_arena(dist.group.WORLD, NAMES, DTYPES, SHAPES)
        entry = {"names": [n for n, _ in got], "values": [t.clone() for _, t in got],
                 "ptrs": [t.data_ptr() for _, t in got]}
        model = nn.Module()
        if step == 1:  # a loader that keeps the received tensor instead of copying it
            model.kept = nn.Parameter(got[0][1], requires_grad=False)
        else:
            model.copied = nn.Parameter(got[0][1].clone(), requires_grad=False)
        entry["released"] = warm_receive.release_if_aliased(model)
        if step == 1:
            report_kept = model.kept
        report.append(entry)
    if rank == 0:
        return None
    return {"rounds": report, "kept_after": report_kept.clone()}


def test_receive_arena_reuses_memory_and_never_overwrites_a_kept_weight():
    _, out = run_workers(_arena_worker, 2, timeout=300)
    rounds = out["rounds"]
    for step, entry in enumerate(rounds):
        assert entry["names"] == NAMES
        for got, want in zip(entry["values"], _expected(step)):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want), step
        assert all(p % 64 == 0 for p in entry["ptrs"])
    assert [e["released"] for e in rounds] == [False, True, False]
    assert rounds[1]["ptrs"] == rounds[0]["ptrs"]  # the second round wrote warm memory
    assert rounds[2]["ptrs"][0] != rounds[1]["ptrs"][0]  # the kept arena was given up ...
    assert torch.equal(out["kept_after"], _expected(1)[0])  # ... so the kept weight survived
