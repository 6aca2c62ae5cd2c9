"""Connecting to (or starting) the Ray cluster a run uses.

On slurm the sbatch script starts a Ray head and workers and the driver connects with
``address="auto"``; on a laptop the driver starts a private local Ray, with a reaper
(``ray/reaper.py``). Only the Ray this process started is ever stopped. ``RAY_AUTH_MODE`` is set
here before Ray starts, unless the user set it; without CUDA every process of the job (trainer
ranks, engine workers, their SGLang servers) gets ``THP_MEM_ALLOC_ENABLE=1``, which must be set
before it allocates (the export, SGLang's receive buffers, its load copy). Why both:
docs/cpu_stack.md, "Ray".
"""
from __future__ import annotations

import os
import tempfile

from ragen_mega.ray.reaper import start_reaper


def init_ray(address: str | None = None, *, num_cpus: int | None = None,
             object_store_memory: int = 1 << 30, temp_dir: str | None = None) -> None:
    """Connect to ``address`` or start a local Ray with a bounded object store."""
    import ray

    import torch

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return
    env = {} if torch.cuda.is_available() else {"THP_MEM_ALLOC_ENABLE": "1"}
    job = dict(log_to_driver=True, runtime_env={"env_vars": env})
    if address:
        ray.init(address=address, **job)
        return
    ray.init(num_cpus=num_cpus, object_store_memory=object_store_memory, include_dashboard=False,
             _temp_dir=temp_dir or tempfile.mkdtemp(prefix="ragen_mega_ray_"), **job)
    global _reaper
    if _reaper is not None:  # the previous local Ray was shut down: let its reaper finish
        _reaper.stdin.close()
    _reaper = start_reaper(_local_ray_pids())


#: the reaper of the local Ray this process started (``ragen_mega/ray/reaper.py``); held for the
#: process's lifetime, since its pipe closing is what sets the reaper off
_reaper = None


def _local_ray_pids() -> list[int]:
    """The pids of the processes Ray started for this process's local node (raylet, GCS, log
    monitor, ...); the reaper also covers their descendants."""
    from ray._private import worker

    node = worker._global_node
    return [info.process.pid for infos in node.all_processes.values() for info in infos
            if info.process is not None]
