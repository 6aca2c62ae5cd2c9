"""Run real megatron-core 0.16.1 on a machine without CUDA (gloo).

``apply_cpu_patches()`` applies patches 1-5 and 7-10 once (nothing when CUDA is available):
CUDA device and sync calls go to the CPU or nowhere (1, 2), the model-parallel "CUDA" RNG
tracker runs on the CPU generator (3), the modules of :data:`_PROXIED_MODULES` get a ``torch``
proxy whose tensor factories map cuda -> cpu (4, 5), ``Tensor.cuda`` returns the tensor (7), and
the MoE token dispatcher gets stand-in streams, numpy split sizes and, on gloo, padded uneven
collectives (8-10). Patch 6 is the context manager ``cuda_tensor_type_names()``, entered only
around Megatron's optimizer construction and step. ``quiet_cpu_warnings()`` silences the
"no TE/Apex" chatter. No patch changes numerics: each picks a device or handles RNG state.

Which Megatron call sites each patch covers, and what to re-check when megatron-core moves:
docs/cpu_stack.md, "The compatibility patches".
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import types
import warnings

import torch

_APPLIED = False
_CPU = torch.device("cpu")

# Modules that create ``device="cuda"`` tensors through their module-level ``torch`` name.
_PROXIED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",        # patch 4
    "megatron.core.transformer.utils",                  # patch 4
    "megatron.core.optimizer.optimizer",                # patch 5
    "megatron.core.optimizer.clip_grads",               # patch 5
    "megatron.core.optimizer.grad_scaler",              # patch 5
    "megatron.core.optimizer.distrib_optimizer",        # patch 5
    "megatron.core.distributed.param_and_grad_buffer",  # patch 5
    "megatron.core.utils",                              # patch 5
)

_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
              "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor", "empty_strided")


def _to_cpu_device(device):
    """Map any cuda device spec (``"cuda"``, ``"cuda:1"``, ``torch.device('cuda')``, int) to cpu."""
    if device is None:
        return None
    if isinstance(device, int) or "cuda" in str(device):
        return _CPU
    return device


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)
    return wrapper


class _CpuTorchProxy(types.ModuleType):
    """Stands in for ``torch`` inside one Megatron module: factories land on the CPU."""

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):  # everything else is the real torch
        return getattr(torch, name)


class _HostEvent:
    """A CUDA event on a machine without one: every host copy has finished already."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _HostStream:
    """A CUDA stream on a machine without one (patch 8): work runs when it is called."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None) -> _HostEvent:
        return _HostEvent()


_CURRENT_STREAM = _HostStream()


def _host_streams() -> types.SimpleNamespace:
    """The ``torch.cuda`` the MoE token dispatcher sees on the CPU (patch 8)."""
    return types.SimpleNamespace(Stream=_HostStream, current_stream=lambda device=None:
                                 _CURRENT_STREAM, stream=lambda stream: contextlib.nullcontext())


def _host_split_sizes(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors already on the CPU (patch 9): the
    numpy array it makes of a CUDA tensor when ``as_numpy``, the tensor itself otherwise."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _uneven_on_gloo(original, padded, sizes_arg: str):
    """Patch 10: ``original`` (a Megatron first-dim collective), except that uneven split
    sizes on a gloo group go through ``padded``."""
    @functools.wraps(original)
    def collective(input_, group, *args, **kwargs):
        bound = dict(zip((sizes_arg, "use_global_buffer"), args)) | kwargs
        sizes = bound.get(sizes_arg)
        if sizes is None or group.size() == 1 or len(set(sizes)) == 1 \
                or torch.distributed.get_backend(group) != "gloo":
            return original(input_, group, *args, **kwargs)
        return padded(input_, group, [int(n) for n in sizes])
    return collective


def _padded_gather(input_, group, sizes: list[int]):
    """All-gather along dim 0 of pieces of ``sizes`` rows, each padded to the largest."""
    dist = torch.distributed
    most = max(sizes)
    piece = input_.new_zeros((most, *input_.shape[1:]))
    piece[:input_.shape[0]] = input_
    gathered = input_.new_empty((most * len(sizes), *input_.shape[1:]))
    dist.all_gather_into_tensor(gathered, piece.contiguous(), group=group)
    return torch.cat([gathered[r * most:r * most + n] for r, n in enumerate(sizes)])


def _padded_reduce_scatter(input_, group, sizes: list[int]):
    """Reduce-scatter along dim 0 into pieces of ``sizes`` rows, each padded to the largest."""
    dist = torch.distributed
    most = max(sizes)
    padded = input_.new_zeros((most * len(sizes), *input_.shape[1:]))
    for r, chunk in enumerate(input_.split(sizes)):
        padded[r * most:r * most + len(chunk)] = chunk
    out = input_.new_empty((most, *input_.shape[1:]))
    dist.reduce_scatter_tensor(out, padded, group=group)
    return out[:sizes[dist.get_rank(group)]]


def _cpu_get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


#: megatron-core's warnings about GPU-only packages and settings, silenced on the CPU so that
#: warnings that matter stay visible
_CPU_NOISE = ("Transformer Engine and Apex are not installed", "Apex is not installed",
              "full scope is deprecated", "When using async grad allreduce it is recommended")


def quiet_cpu_warnings() -> None:
    """Filter :data:`_CPU_NOISE` (call before importing megatron); nothing on a GPU machine."""
    if torch.cuda.is_available():
        return
    for text in _CPU_NOISE:
        warnings.filterwarnings("ignore", message=text, category=UserWarning)


def apply_cpu_patches() -> bool:
    """Apply the patches once. Returns True if they are (now) active, False on CUDA."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    # 1, 2
    torch.cuda.current_device = lambda: _CPU
    torch.cuda.synchronize = lambda *a, **k: None
    # 3 (manual_seed on the default generator: torch.manual_seed would call
    # torch.cuda.manual_seed_all and recurse)
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    from megatron.core.tensor_parallel import random as tp_random
    tp_random._get_cuda_rng_state = _cpu_get_cuda_rng_state
    tp_random._set_cuda_rng_state = _cpu_set_cuda_rng_state
    # 4, 5
    proxy = _CpuTorchProxy()
    for name in _PROXIED_MODULES:
        module = importlib.import_module(name)
        module.torch = proxy
    # 7
    torch.Tensor.cuda = lambda self, *a, **k: self
    # 8 (the dispatcher's view only: replacing torch.cuda.Stream breaks transformers' import)
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    dispatcher_torch = _CpuTorchProxy()
    dispatcher_torch.cuda = _host_streams()
    token_dispatcher.torch = dispatcher_torch
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # 9 (gloo's all_to_all refuses split sizes given as tensors)
    token_dispatcher.maybe_move_tensor_to_cpu = _host_split_sizes
    # 10
    from megatron.core.tensor_parallel import mappings
    mappings._gather_along_first_dim = _uneven_on_gloo(mappings._gather_along_first_dim,
                                                       _padded_gather, "output_split_sizes")
    mappings._reduce_scatter_along_first_dim = _uneven_on_gloo(
        mappings._reduce_scatter_along_first_dim, _padded_reduce_scatter, "input_split_sizes")
    _APPLIED = True
    return True


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor", torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor", torch.bool: "torch.cuda.BoolTensor",
}


@contextlib.contextmanager
def cuda_tensor_type_names():
    """Patch 6: while active, ``t.type()`` (no argument) returns the CUDA type name, which
    Megatron's optimizer wrappers and grad clipping sort parameters by and assert on. Outside
    it, and on GPU machines, ``Tensor.type`` is untouched."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.type

    def cuda_named_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            return _CUDA_TYPE_NAMES.get(self.dtype, original(self))
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = cuda_named_type
    try:
        yield
    finally:
        torch.Tensor.type = original
