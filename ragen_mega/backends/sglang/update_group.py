"""The process group a weight broadcast travels on: the sender is rank 0, each engine's TP ranks
follow. SGLang's engines build their side in ``init_weights_update_group``; this module builds
the sender's side the same way. It is the one place that reaches into torch's private
``distributed_c10d`` helpers: the group must live beside the trainer's own default world (e.g.
Megatron's), which the public ``new_group`` cannot do.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def update_group_store(master_addr: str, master_port: int, world_size: int, *, rank: int = 0,
                       timeout: float = 600.0) -> dist.TCPStore:
    """The rendezvous store of the weight-update group: rank 0 hosts it, the others connect.

    Rank 0 with ``master_port=0`` lets the OS choose the port while binding (read it back from
    ``store.port``): a port picked first and bound later can be taken in between by any process
    on the node (an engine, a Ray worker, an outgoing connection), which fails the rendezvous.
    """
    return dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                         timeout=timedelta(seconds=timeout), wait_for_workers=False)


def join_update_group(store: dist.TCPStore, rank: int, world_size: int, group_name: str,
                      backend: str, timeout: float = 600.0):
    """Join the process group SGLang engines create in ``init_weights_update_group``, built the
    same way (same store prefix). The sender is rank 0 and hosts ``store``
    (:func:`update_group_store`)."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore,
                                                    _new_process_group_helper, _world)

    td = timedelta(seconds=timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend),
                                      PrefixStore(group_name, store), group_name=group_name,
                                      timeout=td)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def leave_update_group(group) -> None:
    """Leave the group on this side (the engines leave theirs over HTTP)."""
    dist.destroy_process_group(group)


def broadcast(tensor, group):
    """Start broadcasting ``tensor`` from the sender (rank 0) to every engine rank; the
    returned work's ``is_completed()`` / ``wait()`` say when it has left."""
    return dist.broadcast(tensor, group=group, group_src=0, async_op=True)
