"""Weight-sync receives on CPU SGLang servers: into memory that is reused, loaded as they land.

For per-tensor ``/update_weights_from_distributed`` SGLang 0.5.23 allocates every tensor with
``torch.empty``, receives all, and only then calls ``load_weights``; on CPU the fresh blocks'
first-touch page faults dominate the receive (a GPU's caching allocator hands back warm memory,
so the plugin steps aside for any non-CPU runner). :func:`warm_receive_plugin` replaces that
receive (docs/cpu_stack.md, "Plugins"; numbers: benchmarks/README.md, "Weight sync from a TP=2
Megatron trainer"):

* tensors are carved, 64-byte aligned, from one arena that lives across updates and grows to the
  largest bucket: from the second sync on the receive writes warm pages, at the cost of one
  bucket of host memory (at most the sender's ``bucket_bytes``) per engine rank;
* reading tensor i waits for its broadcast only, so ``load_weights`` copies tensor i while
  tensor i+1 arrives (gloo receives on its own threads);
* after the load it waits for receives still pending (a load that failed half way) and, if a
  parameter or buffer aliases the arena (a loader kept a received tensor), leaves the arena to
  the model and allocates a new one next update, so reuse never overwrites live weights.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

_TARGET = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater."
_ALIGN = 64

# this server process's receive arena, and the last receive made into it
_state: dict = {"arena": None, "last": None}


class ArrivingWeights(Sequence):
    """``(name, tensor)`` pairs whose broadcasts may still be in flight: reading item i waits
    for its broadcast (and no other)."""

    def __init__(self, items: list[tuple[str, torch.Tensor]], works: list):
        self._items, self._works = items, works

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        self._works[i].wait()
        return self._items[i]

    def wait_all(self) -> None:
        for work in self._works:
            work.wait()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def receive_into_arena(group, names, dtypes, shapes) -> ArrivingWeights:
    """Post one broadcast receive (from rank 0 of ``group``) per tensor, into views of the
    process's arena; return them without waiting."""
    dtypes = [d if isinstance(d, torch.dtype) else getattr(torch, d) for d in dtypes]
    sizes = [torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, dtypes)]
    last = _state["last"]
    if last is not None:  # never write into memory a previous receive may still fill
        last.wait_all()
    arena = _state["arena"]
    needed = sum(map(_aligned, sizes))
    if arena is None or arena.numel() < needed:
        arena = _state["arena"] = torch.empty(needed, dtype=torch.uint8)
        logger.info("warm_receive: weight-sync receive arena of %.1f MiB", needed / 2**20)
    items, works, offset = [], [], 0
    for name, dtype, shape, nbytes in zip(names, dtypes, shapes, sizes):
        tensor = arena[offset:offset + nbytes].view(dtype).view(tuple(shape))
        offset += _aligned(nbytes)
        works.append(torch.distributed.broadcast(tensor, src=0, group=group, async_op=True))
        items.append((name, tensor))
    _state["last"] = ArrivingWeights(items, works)
    return _state["last"]


def release_if_aliased(model) -> bool:
    """Give the arena up (the next receive allocates a new one) if a parameter or buffer of
    ``model`` now lives in it; True if it did."""
    arena = _state["arena"]
    if arena is None:
        return False
    storage = arena.untyped_storage().data_ptr()
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.untyped_storage().data_ptr() == storage for t in tensors):
        return False
    logger.warning("warm_receive: the model kept a received tensor instead of copying it; "
                   "its receive memory is left to the model and not reused")
    _state["arena"] = None
    return True


def warm_receive_plugin() -> None:
    """SGLang general plugin: see the module docstring."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def receive(original, updater, *, names, dtypes, shapes, group_name, load_format=None):
        if load_format == "flattened_bucket" or str(updater.device) != "cpu":
            return original(updater, names=names, dtypes=dtypes, shapes=shapes,
                            group_name=group_name, load_format=load_format)
        if group_name not in updater._model_update_group:
            raise KeyError(f"Group {group_name} not in {list(updater._model_update_group)}. "
                           f"Please call `init_weights_update_group` first.")
        return receive_into_arena(updater._model_update_group[group_name], names, dtypes, shapes)

    def load(original, updater, named_tensors):
        result = original(updater, named_tensors)  # reports its own failures as (False, msg)
        if isinstance(named_tensors, ArrivingWeights):
            try:
                named_tensors.wait_all()
            except Exception as e:  # a broadcast broke: the load above failed on it and said so
                logger.error("warm_receive: a weight broadcast failed: %s", e)
            release_if_aliased(updater.get_model())
        return result

    HookRegistry.register(_TARGET + "receive_weights_from_distributed", receive, HookType.AROUND)
    HookRegistry.register(_TARGET + "load_weights_from_distributed", load, HookType.AROUND)
