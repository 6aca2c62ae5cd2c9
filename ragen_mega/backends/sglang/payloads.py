"""What a colocated weight update hands an SGLang engine: ``(name, tensor)`` lists or SGLang's
flattened buckets, pickled so that only shared-memory handles (CPU) or CUDA IPC handles travel
over HTTP (``/update_weights_from_tensor``). The broadcast transport sends the same flattened
layout (:func:`flatten_bucket`) on the wire.
"""
from __future__ import annotations

import io
from types import SimpleNamespace

import torch


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]]):
    """``(names, dtypes, shapes, flat_uint8)`` in SGLang's ``flattened_bucket`` layout.

    SGLang places tensors back to back without padding and requires each one to start at a
    multiple of its item size, so tensors are ordered by item size, largest first.
    """
    ordered = sorted(bucket, key=lambda nt: -nt[1].element_size())
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in ordered])
    return ([n for n, _ in ordered], [t.dtype for _, t in ordered],
            [list(t.shape) for _, t in ordered], flat)


def engine_payload(bucket: list[tuple[str, torch.Tensor]], *, flattened: bool = False):
    """What SGLang's ``update_weights_from_tensor`` unpickles: the ``(name, tensor)`` list, or
    with ``flattened=True`` SGLang's flattened bucket (one tensor + metadata; the metadata are
    ``SimpleNamespace`` records, which SGLang's restricted unpickler accepts). Keep it alive
    until the receivers have loaded it."""
    if not flattened:
        return list(bucket)
    names, dtypes, shapes, flat = flatten_bucket(bucket)
    metadata, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        metadata.append(SimpleNamespace(name=name, shape=torch.Size(shape), dtype=dtype,
                                        start_idx=offset, end_idx=offset + nbytes,
                                        numel=nbytes))
        offset += nbytes
    return {"flattened_tensor": flat, "metadata": metadata}


def pickle_for_receiver(payload) -> bytes:
    """``payload``'s bytes for ONE receiving process (an engine's TP rank).

    Tensors are shared, not copied: CUDA tensors by IPC handle, CPU tensors by a shared-memory
    file. On CPU that needs the ``file_system`` sharing strategy (``file_descriptor`` passes fds
    the server cannot receive over HTTP, and the server dies). Each pickling takes one reference
    on the file and each unpickling gives one back, so bytes read by several processes unlink the
    file under the later readers (``unable to open shared memory object ... No such file or
    directory``): hence one pickle per receiver.
    """
    # `import torch` has already registered torch's tensor reductions with ForkingPickler.
    from multiprocessing.reduction import ForkingPickler

    tensors = ([payload["flattened_tensor"]] if isinstance(payload, dict)
               else [t for _, t in payload])
    if any(t.device.type == "cpu" for t in tensors):
        torch.multiprocessing.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(payload)
    return buf.getvalue()
