"""Connecting to (or starting) the Ray cluster a run uses.

On a slurm cluster the sbatch script starts a Ray head and workers and the driver connects with
``address="auto"``; on a laptop the driver starts a private local Ray. Every process must agree
on ``RAY_AUTH_MODE`` (a mismatch fails with InvalidAuthToken), so it is set here, once, before
Ray starts, unless the user set it. Only the Ray this process started is ever stopped.
"""
from __future__ import annotations

import os
import tempfile


def init_ray(address: str | None = None, *, num_cpus: int | None = None,
             object_store_memory: int = 1 << 30, temp_dir: str | None = None) -> None:
    """Connect to ``address`` or start a local Ray with a bounded object store."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    ray.init(num_cpus=num_cpus, object_store_memory=object_store_memory, include_dashboard=False,
             _temp_dir=temp_dir or tempfile.mkdtemp(prefix="ragen_mega_ray_"),
             log_to_driver=True)
