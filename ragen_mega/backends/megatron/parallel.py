"""Process groups for the Megatron trainer: torch.distributed + megatron parallel_state + RNG.

Layout: Megatron's default order ``tp-cp-ep-dp-pp``: TP ranks are adjacent, PP outermost.
DP = world_size / (tp * pp). Expert parallelism (EP) is carved out of DP: the ``ep`` ranks of
one group hold different experts and the same dense weights, so experts are replicated over
DP / EP ranks only. ``backend=None`` picks nccl with CUDA, gloo otherwise; on CPU the
``cpu_compat`` patches are applied here, before any Megatron object exists.
"""
from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from ragen_mega.backends.megatron.cpu_compat import apply_cpu_patches


@dataclasses.dataclass(frozen=True)
class ParallelInfo:
    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    vpp: int | None
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    ep: int = 1
    ep_rank: int = 0


def init_parallel(rank: int, world_size: int, init_method: str, tp: int = 1, pp: int = 1,
                  vpp: int | None = None, backend: str | None = None, seed: int = 1234,
                  timeout_minutes: int = 30, ep: int = 1,
                  store: dist.Store | None = None) -> ParallelInfo:
    """Join the process group and build Megatron's TP/PP/DP/EP groups and model-parallel RNG.

    ``init_method``: a torch.distributed URL (``file:///tmp/x`` avoids the port reuse races of
    back-to-back ``tcp://`` launches), or ``store`` (a :func:`tcp_store`); ignored when the
    process group exists. Existing Megatron groups are replaced, so one launch can visit several
    TP x PP layouts. ``vpp``: virtual pipeline chunks per rank (interleaved schedule) or None.
    """
    if tp < 1 or pp < 1 or ep < 1:
        raise ValueError(f"init_parallel: tp, pp and ep must be >= 1, got tp={tp}, pp={pp}, "
                         f"ep={ep}")
    if world_size % (tp * pp * ep):
        raise ValueError(f"init_parallel: world_size={world_size} is not divisible by "
                         f"tp*pp*ep={tp}*{pp}*{ep}={tp * pp * ep}")
    if vpp is not None and (vpp < 1 or pp == 1):
        raise ValueError(f"init_parallel: vpp={vpp} needs pp > 1 and vpp >= 1 (pp={pp})")
    if not 0 <= rank < world_size:
        raise ValueError(f"init_parallel: rank={rank} outside [0, world_size={world_size})")
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
    else:
        apply_cpu_patches()

    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=None if store else init_method,
                                store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    if mpu.model_parallel_is_initialized():  # re-layout inside one launch (tests loop over TPxPP)
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=vpp,
                                  expert_model_parallel_size=ep,
                                  distributed_timeout_minutes=timeout_minutes)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return parallel_info()


def parallel_info() -> ParallelInfo:
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        raise RuntimeError("parallel_info: call init_parallel first")
    tp = mpu.get_tensor_model_parallel_world_size()
    pp = mpu.get_pipeline_model_parallel_world_size()
    return ParallelInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(), tp=tp, pp=pp,
        dp=mpu.get_data_parallel_world_size(),
        vpp=mpu.get_virtual_pipeline_model_parallel_world_size(),
        tp_rank=mpu.get_tensor_model_parallel_rank(), pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(), device=local_device(),
        ep=mpu.get_expert_model_parallel_world_size(), ep_rank=mpu.get_expert_model_parallel_rank())


def local_device() -> torch.device:
    """This rank's device: the CUDA device ``init_parallel`` set, or the CPU. Collective
    tensors (NCCL takes CUDA tensors only), batches and model buffers go there."""
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def tcp_store(host: str, port: int, world_size: int, *, master: bool,
              timeout_minutes: int = 30) -> dist.TCPStore:
    """The process group's rendezvous store. Open the master (rank 0) with ``port=0`` and tell
    the others ``store.port``: the OS picks a free port while binding it, where a port probed
    first and bound later can be taken in between (EADDRINUSE)."""
    return dist.TCPStore(host, port, world_size, is_master=master, wait_for_workers=False,
                         timeout=datetime.timedelta(minutes=timeout_minutes))


def file_init_method(directory: str | os.PathLike) -> str:
    """A ``file://`` rendezvous URL inside ``directory`` (the file must not exist yet)."""
    return "file://" + os.path.join(os.path.abspath(directory), "rendezvous")
