"""Ship a model's weights, as ``(hf_name, tensor)`` pairs, into running SGLang engines.

The trainer side of weight sync, independent of how the tensors were produced (Megatron export,
a plain ``state_dict``): tensors are packed into buckets of about ``bucket_bytes`` (a tensor
larger than a bucket goes alone) so only one bucket is in flight at a time, then each bucket is

* ``mode="distributed"`` (trainer and engines on different devices/nodes): broadcast from rank 0
  of a process group that the sender and every engine TP rank joined (engine ``i`` takes ranks
  ``1 + sum(tp of engines before i)`` onwards). SGLang's ``/update_weights_from_distributed``
  answers only after the broadcast has arrived, so the HTTP calls run on the clients' threads
  while this thread broadcasts; if an engine refuses the update, the broadcast is abandoned with
  an error instead of waiting forever.
* ``mode="tensor"`` (colocated: sender and engine on the same host/GPU): serialized with torch's
  multiprocessing pickler, so only handles (CUDA IPC, or a shared-memory file on CPU) travel
  over HTTP.

Each :meth:`BucketedWeightSender.send` is one ``begin_weight_update``/``end_weight_update``
session per engine, flushes the prefix cache with the last bucket, then labels the engines with
the new weight version. It is pipelined one bucket deep: while bucket k travels, the next one is
drawn from the (lazy) input, e.g. a Megatron export gathering the next shards. Given the input's
``layout`` (names, shapes and dtypes known before the tensors, as ``DirectExport.layout``), a
distributed per-tensor sync goes further and streams: each bucket is announced to the engines
first, and each tensor goes on the wire the moment it is drawn. Pausing generation around a sync
is the caller's choice (``EngineClient.pause_generation`` / ``continue_generation``).

The design follows slime's ``UpdateWeightFromDistributed`` (buckets, a custom group with the
trainer at rank 0, HTTP calls overlapped with the broadcast); the code is our own.
"""
from __future__ import annotations

import io
import time
from collections import deque
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from ragen_mega.backends.sglang.client import EngineClient, EngineError

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, in order, into lists of at most ``bucket_bytes`` bytes;
    a tensor larger than ``bucket_bytes`` forms a bucket of its own."""
    return (bucket for bucket, _ in _buckets(named_tensors, bucket_bytes))


def _buckets(named_tensors, bucket_bytes: int):
    """``iter_buckets`` as ``(bucket, is_last)``: known without drawing the next bucket."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        tensor = tensor.detach().contiguous()
        nbytes = tensor.nbytes
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket, True


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

    Tensors are shared, not copied into the bytes: CUDA tensors by IPC handle, CPU tensors by a
    shared-memory file. On CPU that needs the ``file_system`` sharing strategy (the default
    ``file_descriptor`` strategy passes fds that the server cannot receive over HTTP, and the
    server process dies). There each pickling takes one reference on the file and each
    unpickling in another process gives one back, so the same bytes read by several processes
    give back more than they took: the file is unlinked under the later readers (three engines:
    ``unable to open shared memory object ... No such file or directory``). Hence one pickle per
    receiver.
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
    """Join the process group that SGLang engines create in ``init_weights_update_group``.

    The sender is rank 0 (it hosts ``store``, see :func:`update_group_store`). The group is
    separate from the default one, so the trainer keeps its own (e.g. Megatron's)
    ``torch.distributed`` world; it is built the way SGLang builds its side (same store prefix).
    """
    from torch.distributed.distributed_c10d import (Backend, PrefixStore,
                                                    _new_process_group_helper, _world)

    td = timedelta(seconds=timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend),
                                      PrefixStore(group_name, store), group_name=group_name,
                                      timeout=td)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@dataclass
class SyncStats:
    """What one :meth:`BucketedWeightSender.send` moved and how long it took."""

    version: str
    num_tensors: int
    num_buckets: int
    num_bytes: int
    seconds: float


class BucketedWeightSender:
    """Sends ``(hf_name, tensor)`` streams into one or more SGLang engines, bucket by bucket.

    ``engines``: :class:`EngineClient` per engine. ``mode``: ``"distributed"`` (broadcast over a
    process group; call :meth:`connect` first) or ``"tensor"`` (colocated, shared memory/IPC).
    ``bucket_bytes``: bucket size (default 512 MiB). ``load_format``: ``None`` (tensors one by
    one) or ``"flattened_bucket"`` (one flat tensor per bucket). ``backend``: ``"gloo"`` or
    ``"nccl"`` (default: nccl when CUDA is available). ``engine_tp_sizes``: ranks each engine
    takes in the group (default: asked from each engine's ``/server_info``).
    """

    def __init__(self, engines: Sequence[EngineClient], *, mode: str = "distributed",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, load_format: str | None = None,
                 backend: str | None = None, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, group_name: str = "ragen_mega_weight_sync",
                 engine_tp_sizes: Sequence[int] | None = None, timeout: float = 600.0):
        if mode not in ("distributed", "tensor"):
            raise ValueError(f"BucketedWeightSender: mode must be 'distributed' or 'tensor', "
                             f"got {mode!r}")
        if load_format not in (None, "flattened_bucket"):
            raise ValueError("BucketedWeightSender: load_format must be None or "
                             f"'flattened_bucket', got {load_format!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"BucketedWeightSender: bucket_bytes must be > 0, got {bucket_bytes}")
        if not engines:
            raise ValueError("BucketedWeightSender: engines must not be empty")
        if engine_tp_sizes is not None and len(engine_tp_sizes) != len(engines):
            raise ValueError(f"BucketedWeightSender: engine_tp_sizes has {len(engine_tp_sizes)} "
                             f"entries for {len(engines)} engines")
        self.engines = list(engines)
        self.mode = mode
        self.bucket_bytes = bucket_bytes
        self.load_format = load_format
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.master_addr = master_addr
        self.master_port = master_port
        self.group_name = group_name
        self.engine_tp_sizes = list(engine_tp_sizes) if engine_tp_sizes else None
        self.timeout = timeout
        self.group = None

    def _tp_sizes(self) -> list[int]:
        if self.engine_tp_sizes is None:
            self.engine_tp_sizes = [int(e.server_info()["tp_size"]) for e in self.engines]
        return self.engine_tp_sizes

    def connect(self) -> None:
        """Create the broadcast group: every engine joins over HTTP while this process joins as
        rank 0 (distributed mode only)."""
        if self.mode != "distributed":
            raise RuntimeError("BucketedWeightSender.connect is for mode='distributed' only")
        if self.group is not None:
            return
        tp_sizes = self._tp_sizes()
        world_size = 1 + sum(tp_sizes)
        store = update_group_store(self.master_addr, self.master_port or 0, world_size,
                                   timeout=self.timeout)
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
        futures = [e.submit("init_weights_update_group", self.master_addr, store.port, offset,
                            world_size, self.group_name, self.backend, timeout=self.timeout)
                   for e, offset in zip(self.engines, offsets)]
        # joined on a thread of its own, so that an engine that fails to join (its server died)
        # ends the wait at once instead of after the rendezvous' time-out
        pool = ThreadPoolExecutor(1, thread_name_prefix="weight-update-join")
        joining = pool.submit(join_update_group, store, 0, world_size, self.group_name,
                              self.backend, self.timeout)
        pool.shutdown(wait=False)
        wait([joining, *futures], return_when=FIRST_EXCEPTION)
        refused = [f for f in futures if f.done() and f.exception() is not None]
        if refused and not joining.done():
            raise EngineError(f"an engine did not join the weight-update group (this side is "
                              f"left waiting in the rendezvous until its {self.timeout:g} s "
                              f"time-out): {refused[0].exception()}")
        try:
            self.group = joining.result()
        except BaseException:
            for f in futures:  # our side's error is the news; the engines' calls would only
                f.cancel()     # end at their time-out and hide it
            raise
        for f in futures:
            f.result()

    def close(self) -> None:
        """Tear the broadcast group down on the engines and here (after an abandoned broadcast
        this waits until the pending broadcast fails or ``timeout`` passes)."""
        self._leave_group(self.engines)

    def _leave_group(self, engines: Sequence[EngineClient]) -> None:
        """Tear the broadcast group down on ``engines`` and here."""
        if self.group is None:
            return
        group, self.group = self.group, None
        errors = []
        for e in engines:
            try:
                e.destroy_weights_update_group(self.group_name)
            except EngineError as err:
                errors.append(str(err))
        dist.destroy_process_group(group)
        if errors:
            raise EngineError("destroy_weights_update_group failed: " + "; ".join(errors))

    def replace_engines(self, engines: dict[int, EngineClient]) -> None:
        """Send to ``engines`` (index -> client of a restarted server, same TP size) instead of
        the engines of those indices, whose servers are gone. Distributed mode: the engines
        kept leave the broadcast group (the gone ones cannot; their ranks only vanish) and
        everyone joins a new one. After a broadcast that an engine's death broke, every engine
        is replaced: the others wait in its receive, which never completes, and would not
        answer a request to leave; then only this process leaves the old group."""
        if not engines:
            return
        kept = [e for i, e in enumerate(self.engines) if i not in engines]
        if self.mode == "distributed":
            self._leave_group(kept)
        for index, engine in engines.items():
            self.engines[index].close()
            self.engines[index] = engine
        if self.mode == "distributed":
            self.connect()

    def __enter__(self) -> "BucketedWeightSender":
        if self.mode == "distributed":
            self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str | int, *,
             layout: Sequence[tuple[str, Sequence[int], torch.dtype]] | None = None
             ) -> SyncStats:
        """Load all ``named_tensors`` into every engine, then set their weight version.

        Pipelined one bucket deep: bucket k is broadcast (or shared) in the background while
        this thread draws bucket k+1 from ``named_tensors`` (for a Megatron export, that is
        when the next shards are gathered); bucket k+1 starts once bucket k has landed.

        ``layout`` (distributed mode with per-tensor loading): the ``(name, shape, dtype)`` of
        every tensor ``named_tensors`` will yield, in order, known before they exist (e.g.
        ``DirectExport.layout``). Then the pipeline goes down to single tensors: each bucket is
        announced to the engines before its tensors are drawn, and every tensor goes on the
        wire as soon as it is drawn, so a bucket's export overlaps its own broadcast; at most
        ``bucket_bytes`` of drawn tensors wait for the wire. A stream that departs from its
        layout raises ``ValueError`` at once; the engines are then stuck in the announced
        receive, and the group is unusable (as after a refused update).
        """
        if self.mode == "distributed" and self.group is None:
            raise RuntimeError("BucketedWeightSender.send: call connect() first "
                               "(or use the sender as a context manager)")
        start = time.perf_counter()
        for e in self.engines:
            e.begin_weight_update()
        if layout is not None and self.mode == "distributed" and self.load_format is None:
            n_tensors, n_buckets, n_bytes = self._stream(named_tensors, layout)
        else:
            n_tensors, n_buckets, n_bytes = self._send_buckets(named_tensors)
        for e in self.engines:
            e.update_weight_version(str(version))
        return SyncStats(version=str(version), num_tensors=n_tensors, num_buckets=n_buckets,
                         num_bytes=n_bytes, seconds=time.perf_counter() - start)

    def _send_buckets(self, named_tensors) -> tuple[int, int, int]:
        """:meth:`send` without a layout: bucket k travels while bucket k+1 is drawn."""
        n_tensors = n_buckets = n_bytes = 0
        in_flight = None  # finish() of the bucket being sent
        try:
            for bucket, last in _buckets(named_tensors, self.bucket_bytes):
                if in_flight is not None:  # one bucket on the wire at a time
                    in_flight, finish = None, in_flight
                    finish()
                # the prefix cache is flushed only with the last bucket
                in_flight = self._start_bucket(bucket, flush_cache=last)
                n_buckets += 1
                n_tensors += len(bucket)
                n_bytes += sum(t.nbytes for _, t in bucket)
            if in_flight is None:
                raise ValueError("BucketedWeightSender.send: named_tensors was empty")
            in_flight, finish = None, in_flight
            finish()
        finally:
            try:
                if in_flight is not None:  # drawing the next bucket failed: land this one first
                    in_flight()
            finally:
                for e in self.engines:
                    e.end_weight_update()
        return n_tensors, n_buckets, n_bytes

    def _stream(self, named_tensors, layout) -> tuple[int, int, int]:
        """:meth:`send` with a layout: announce each bucket, then broadcast tensor by tensor."""
        if not layout:
            raise ValueError("BucketedWeightSender.send: layout was empty")
        metas = ((name, torch.empty(tuple(shape), dtype=dtype, device="meta"))
                 for name, shape, dtype in layout)
        buckets = list(iter_buckets(metas, self.bucket_bytes))
        stream = iter(named_tensors)
        on_wire: deque = deque()  # (work, tensor): broadcasts not known to be complete
        wire_bytes = n_bytes = 0
        announced: list = []  # the HTTP calls of the bucket being received
        for i, bucket in enumerate(buckets):
            _answered(announced)  # an engine takes bucket k+1's request only after bucket k
            announced = [e.submit("update_weights_from_distributed", [n for n, _ in bucket],
                                  [t.dtype for _, t in bucket], [list(t.shape) for _, t in bucket],
                                  self.group_name, flush_cache=i == len(buckets) - 1,
                                  load_format=None, timeout=self.timeout)
                         for e in self.engines]
            for name, meta in bucket:
                tensor = _expect(next(stream, None), name, meta)
                while on_wire and wire_bytes > self.bucket_bytes:
                    work, sent = on_wire.popleft()
                    self._await_broadcast([work], announced)
                    wire_bytes -= sent.nbytes
                on_wire.append((dist.broadcast(tensor, group=self.group, group_src=0,
                                               async_op=True), tensor))
                wire_bytes += tensor.nbytes
                n_bytes += tensor.nbytes
        extra = next(stream, None)
        if extra is not None:
            raise ValueError(f"BucketedWeightSender.send: the tensors go on past their layout "
                             f"({len(layout)} entries): {extra[0]!r} was not announced")
        self._await_broadcast([w for w, _ in on_wire], announced)
        _answered(announced)
        for e in self.engines:
            e.end_weight_update()
        return len(layout), len(buckets), n_bytes
    def _start_bucket(self, bucket, *, flush_cache: bool):
        """Start sending one bucket; return ``finish()``, which waits until every engine has
        it (and raises :class:`EngineError` if one refused or the time ran out)."""
        if self.mode == "distributed":
            return self._start_broadcast(bucket, flush_cache)
        return self._start_share(bucket, flush_cache)

    def _start_broadcast(self, bucket, flush_cache: bool):
        flattened = self.load_format == "flattened_bucket"
        if flattened:
            names, dtypes, shapes, flat = flatten_bucket(bucket)
            tensors = [flat]
        else:
            names = [n for n, _ in bucket]
            dtypes = [t.dtype for _, t in bucket]
            shapes = [list(t.shape) for _, t in bucket]
            tensors = [t for _, t in bucket]
        futures = [e.submit("update_weights_from_distributed", names, dtypes, shapes,
                            self.group_name, flush_cache=flush_cache,
                            load_format=self.load_format, timeout=self.timeout)
                   for e in self.engines]
        works = [dist.broadcast(t, group=self.group, group_src=0, async_op=True)
                 for t in tensors]

        def finish(_keep_alive=tensors) -> None:  # the tensors live until their broadcast ends
            self._await_broadcast(works, futures)
            _answered(futures)

        return finish

    def _await_broadcast(self, works, futures) -> None:
        """Wait until the broadcasts ``works`` are done; fail at once if an engine refused its
        update (``futures``: it never receives, so the broadcast would hang) or after
        ``timeout``."""
        deadline = time.monotonic() + self.timeout
        while not all(w.is_completed() for w in works):
            failed = [f for f in futures if f.done() and f.exception() is not None]
            if failed:
                raise EngineError(
                    f"weight broadcast abandoned, the process group {self.group_name!r} is "
                    f"now unusable (close() it, which waits until the pending broadcast "
                    f"fails or times out, then connect() again): {failed[0].exception()}")
            if time.monotonic() > deadline:
                raise EngineError(f"weight broadcast did not finish within "
                                  f"{self.timeout:g} s ({len(works)} tensors)")
            time.sleep(0.001)
        for w in works:
            w.wait()

    def _start_share(self, bucket, flush_cache: bool):
        flattened = self.load_format == "flattened_bucket"
        payload = engine_payload(bucket, flattened=flattened)
        futures = [e.submit("update_weights_from_tensor",
                            [pickle_for_receiver(payload) for _ in range(tp)],
                            load_format=self.load_format, flush_cache=flush_cache,
                            timeout=self.timeout)
                   for e, tp in zip(self.engines, self._tp_sizes())]

        def finish(_keep_alive=payload) -> None:  # the tensors' shared memory lives until here
            _answered(futures)

        return finish


def send_export(export, sender: BucketedWeightSender | None, version: str | int, *,
                streamed: bool = True, before: Callable[[], None] | None = None
                ) -> SyncStats | None:
    """One rank's part in a weight sync whose tensors come from a collective export, which every
    rank iterates to its end (``DirectExport``: the other ranks send their shards to the sending
    one). ``sender``: the sending rank's, None on the others (they only send their shards on).
    ``streamed``: the sender follows the export's ``layout``. ``before``: what the sending rank
    does first (take restarted engines into its channel), failing as the send would.

    A send that fails (an engine died mid-sync, refused the update, or did not join the group)
    still draws the rest of the export, dropping it, before the error is raised: the other ranks
    are sending their shards to this one and would otherwise wait in the export forever. So
    every rank returns, the error reaches the caller from the sending rank, and the run can
    restart the engines and sync again."""
    tensors = iter(export)
    if sender is None:
        for _ in tensors:
            pass
        return None
    try:
        if before is not None:
            before()
        return sender.send(tensors, version, layout=export.layout if streamed else None)
    except Exception:
        for _ in tensors:
            pass
        raise


def _answered(futures) -> None:
    """Wait for every engine's answer to an update, raising the first failure as soon as it
    comes: an engine that died must not leave this waiting on the others' answers, which wait
    for a broadcast its death keeps from completing."""
    wait(futures, return_when=FIRST_EXCEPTION)
    for f in futures:
        if f.done() and f.exception() is not None:
            raise f.exception()
    for f in futures:
        f.result()


def _expect(item, name: str, meta: torch.Tensor) -> torch.Tensor:
    """The tensor of a streamed ``(name, tensor)`` item, checked against its layout entry."""
    if item is None:
        raise ValueError(f"BucketedWeightSender.send: the tensors ended before their layout: "
                         f"{name!r} was announced but never came")
    got, tensor = item
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"weight {got!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if (got, tuple(tensor.shape), tensor.dtype) != (name, tuple(meta.shape), meta.dtype):
        raise ValueError(f"BucketedWeightSender.send: the tensors depart from their layout: "
                         f"expected {name!r} {tuple(meta.shape)} {meta.dtype}, got {got!r} "
                         f"{tuple(tensor.shape)} {tensor.dtype}")
    return tensor.detach().contiguous()
