"""Run a function on N local processes with Megatron's process groups set up (tests and tools).

Each worker (spawned, so no inherited process groups or CUDA state) joins a ``file://``
rendezvous in a fresh temp directory, calls ``init_parallel`` with the layout, runs
``fn(rank, world_size, *args)`` and writes the picklable result to a file (a queue's
shared-memory tensors die with the worker that made them). A worker exception is raised in the
parent as ``WorkerError`` with the rank and traceback; a worker that hangs past ``timeout``
seconds or dies without a result stops the launch. All workers are killed by PID before
returning or raising. ``fn`` must be a module-level function.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import tempfile
import time
import traceback

import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A worker raised: ``rank`` and the worker's formatted ``worker_traceback``."""

    def __init__(self, rank: int, worker_traceback: str):
        super().__init__(f"worker rank {rank} failed:\n{worker_traceback}")
        self.rank = rank
        self.worker_traceback = worker_traceback


def _worker(rank, world_size, tmp, fn, args, layout, threads):
    import torch

    os.setsid()  # its own process group: the parent can stop it with any children it started
    torch.set_num_threads(threads)
    try:
        from ragen_mega.backends.megatron.cpu_compat import quiet_cpu_warnings

        quiet_cpu_warnings()
        from ragen_mega.backends.megatron.parallel import (destroy_parallel, file_init_method,
                                                           init_parallel)

        init_parallel(rank, world_size, file_init_method(tmp), **layout)
        try:
            result = fn(rank, world_size, *args)
        finally:
            destroy_parallel()
        with open(os.path.join(tmp, f"result_{rank}.tmp"), "wb") as f:
            pickle.dump(result, f)
        os.replace(os.path.join(tmp, f"result_{rank}.tmp"), os.path.join(tmp, f"result_{rank}.pkl"))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        with open(os.path.join(tmp, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1)


def run_workers(fn, world_size: int, *args, tp: int = 1, pp: int = 1, vpp: int | None = None,
                ep: int = 1, seed: int = 1234, timeout: float = 300.0,
                threads_per_worker: int = 1) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank."""
    if world_size < 1:
        raise ValueError(f"run_workers: world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    layout = dict(tp=tp, pp=pp, vpp=vpp, ep=ep, seed=seed)
    with tempfile.TemporaryDirectory(prefix="ragen_mega_launch_") as tmp:
        # Not daemonic: torch_dist saving starts helper processes, which a daemon may not.
        procs = [ctx.Process(target=_worker,
                             args=(r, world_size, tmp, fn, args, layout, threads_per_worker))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            _wait(procs, tmp, timeout)
            results = []
            for r in range(world_size):
                with open(os.path.join(tmp, f"result_{r}.pkl"), "rb") as f:
                    results.append(pickle.load(f))
            return results
        finally:
            for p in procs:  # the worker and whatever it spawned (torch_dist's writers)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                if p.is_alive():  # killed before it could make its own group
                    p.kill()
            for p in procs:
                p.join(timeout=10)


def _wait(procs, tmp, timeout):
    """Return when every worker finished with a result; raise on the first failure or timeout."""
    deadline = time.monotonic() + timeout
    while True:
        for r, p in enumerate(procs):
            err = os.path.join(tmp, f"error_{r}.txt")
            if os.path.exists(err) and not p.is_alive():
                with open(err) as f:
                    raise WorkerError(r, f.read())
            if p.exitcode is not None and not os.path.exists(os.path.join(tmp, f"result_{r}.pkl")):
                if not os.path.exists(err):
                    raise WorkerError(r, f"process {p.pid} exited with code {p.exitcode} "
                                         "without a result (killed or crashed)")
        if all(os.path.exists(os.path.join(tmp, f"result_{r}.pkl")) for r in range(len(procs))):
            return
        if time.monotonic() > deadline:
            pending = [r for r in range(len(procs))
                       if not os.path.exists(os.path.join(tmp, f"result_{r}.pkl"))]
            raise TimeoutError(f"run_workers: ranks {pending} still running after {timeout:.0f} s "
                               "(hung collective? a rank that skipped a collective?)")
        time.sleep(0.05)
