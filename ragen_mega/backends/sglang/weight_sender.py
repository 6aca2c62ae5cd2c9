"""Ship a model's weights, as ``(hf_name, tensor)`` pairs, into running SGLang engines.

The trainer side of weight sync, whatever produced the tensors (Megatron export, a plain
``state_dict``): buckets of about ``bucket_bytes`` (a larger tensor goes alone), one in flight,
each sent by one of two transports along :meth:`BucketedWeightSender.send` (docs/design.md,
"Weight sync, streamed"):

* ``mode="distributed"``: broadcast from rank 0 of a group that every engine TP rank joined
  (engine ``i`` takes ranks ``1 + sum(tp of engines before i)`` onwards; ``update_group.py``).
  SGLang's ``/update_weights_from_distributed`` answers only after the broadcast has arrived, so
  the HTTP calls run on the clients' threads while this thread broadcasts; if an engine refuses
  the update, the broadcast is abandoned with an error instead of waiting forever.
* ``mode="tensor"`` (colocated): pickled with torch's multiprocessing pickler, so only handles
  (CUDA IPC, or a shared-memory file on CPU) travel over HTTP (``payloads.py``).

Pausing generation around a sync is the caller's choice (``EngineClient.pause_generation`` /
``continue_generation``). The design follows slime's ``UpdateWeightFromDistributed`` (buckets, a
custom group with the trainer at rank 0, HTTP calls overlapped with the broadcast); the code is
our own.
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator, Sequence

import torch

from ragen_mega.backends.sglang.client import EngineClient, EngineError
from ragen_mega.backends.sglang.payloads import (engine_payload, flatten_bucket,
                                                 pickle_for_receiver)
from ragen_mega.backends.sglang.update_group import (broadcast, join_update_group,
                                                     leave_update_group, update_group_store)

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
#: how long a failed update waits for the engines to close their sessions: one that died cannot,
#: and one left in a broken broadcast's receive answers only when that receive fails
CLOSE_AFTER_FAILURE_S = 5.0


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


@dataclass
class Bucket:
    """One update's worth of tensors: what the engines are told to expect (``names``,
    ``dtypes``, ``shapes``, in SGLang's ``load_format``), and the tensors that carry it, drawn
    lazily when the bucket was planned from a layout. ``flush_cache``: the last bucket."""

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]
    tensors: Iterable[torch.Tensor]
    load_format: str | None
    flush_cache: bool

    @classmethod
    def of(cls, pairs: list[tuple[str, torch.Tensor]], *, flattened: bool,
           flush_cache: bool) -> "Bucket":
        """A bucket of tensors in hand; ``flattened``: as one uint8 tensor."""
        if flattened:
            names, dtypes, shapes, flat = flatten_bucket(pairs)
            return cls(names, dtypes, shapes, [flat], "flattened_bucket", flush_cache)
        return cls([n for n, _ in pairs], [t.dtype for _, t in pairs],
                   [list(t.shape) for _, t in pairs], [t for _, t in pairs], None, flush_cache)


@dataclass
class SyncStats:
    """What one :meth:`BucketedWeightSender.send` moved and how long it took (counted as the
    buckets go on their way)."""

    version: str
    num_tensors: int = 0
    num_buckets: int = 0
    num_bytes: int = 0
    seconds: float = 0.0

    def add(self, tensors: int, nbytes: int) -> None:
        self.num_tensors += tensors
        self.num_buckets += 1
        self.num_bytes += nbytes


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
        futures = [e.submit(e.aio.init_weights_update_group(
                       self.master_addr, store.port, offset, world_size, self.group_name,
                       self.backend, timeout=self.timeout))
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
        leave_update_group(group)
        if errors:
            raise EngineError("destroy_weights_update_group failed: " + "; ".join(errors))

    def replace_engines(self, engines: dict[int, EngineClient]) -> None:
        """Send to ``engines`` (index -> client of a restarted server, same TP size) in place of
        the gone servers of those indices. Distributed mode: the kept engines leave the broadcast
        group (the gone ones cannot; their ranks just vanish) and all join a new one. After a
        broadcast broken by an engine's death every engine is replaced (the others wait in a
        receive that never completes and would not answer a request to leave), and only this
        process leaves the old group."""
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
        """Load all ``named_tensors`` into every engine, then label them with ``version``.

        One path for both transports: one ``begin_weight_update``/``end_weight_update`` session
        per engine around the whole update (:meth:`_sessions`); the tensors go bucket by bucket
        (:meth:`_drawn`, or :meth:`_planned` from a layout), each started while the next is drawn
        from the lazy input (e.g. a Megatron export gathering the next shards) and finished
        before the next starts; the last bucket flushes the prefix cache; only a complete update
        sets ``version``.

        ``layout`` (distributed mode, per-tensor loading): the ``(name, shape, dtype)`` of every
        tensor ``named_tensors`` will yield, in order, known before they exist (e.g.
        ``DirectExport.layout``). Each bucket is then announced to the engines before its
        tensors are drawn, and each tensor goes on the wire as soon as it is drawn, so a
        bucket's export overlaps its own broadcast. A stream that departs from its layout raises
        ``ValueError`` at once; the engines are then stuck in the announced receive and the
        group is unusable (as after a refused update).
        """
        if self.mode == "distributed" and self.group is None:
            raise RuntimeError("BucketedWeightSender.send: call connect() first "
                               "(or use the sender as a context manager)")
        start = time.perf_counter()
        streamed = layout is not None and self.mode == "distributed" and self.load_format is None
        stats = SyncStats(str(version))
        with self._sessions():
            finish = None  # of the bucket on its way
            try:
                for bucket in (self._planned(named_tensors, layout) if streamed
                               else self._drawn(named_tensors)):
                    if finish is not None:  # one bucket on the wire at a time
                        finish, landed = None, finish
                        landed()
                    finish = self._start(bucket, stats)
                if finish is None:
                    raise ValueError("BucketedWeightSender.send: named_tensors was empty")
            finally:
                if finish is not None:  # also when drawing the next bucket failed: land this
                    finish()            # one before the error goes up
        for e in self.engines:
            e.update_weight_version(str(version))
        stats.seconds = time.perf_counter() - start
        return stats

    @contextlib.contextmanager
    def _sessions(self):
        """Every engine's weight-update session around one update (SGLang refuses an update
        outside one). After a failure the sessions are closed as far as the engines answer
        within :data:`CLOSE_AFTER_FAILURE_S`, and the update's own error is what is raised."""
        opened = []
        try:
            for e in self.engines:
                e.begin_weight_update()
                opened.append(e)
            yield
        except BaseException:
            wait([e.submit(e.aio.end_weight_update()) for e in opened],
                 timeout=CLOSE_AFTER_FAILURE_S)
            raise
        for e in opened:
            e.end_weight_update()

    def _drawn(self, named_tensors) -> Iterator[Bucket]:
        """Buckets of tensors in hand: bucket k+1 is drawn while bucket k is on the wire."""
        # the broadcast sends a flattened bucket as one tensor; the shared-memory payload
        # flattens its own (engine_payload)
        flattened = self.mode == "distributed" and self.load_format == "flattened_bucket"
        for pairs, last in _buckets(named_tensors, self.bucket_bytes):
            yield Bucket.of(pairs, flattened=flattened, flush_cache=last)

    def _planned(self, named_tensors, layout) -> Iterator[Bucket]:
        """Buckets cut from ``layout``, whose tensors are drawn from ``named_tensors`` only as
        the bucket goes on the wire (each checked against its layout entry)."""
        if not layout:
            raise ValueError("BucketedWeightSender.send: layout was empty")
        metas = ((name, torch.empty(tuple(shape), dtype=dtype, device="meta"))
                 for name, shape, dtype in layout)
        planned = list(iter_buckets(metas, self.bucket_bytes))
        stream = iter(named_tensors)

        def drawn(pairs, last: bool):
            for name, meta in pairs:
                yield _expect(next(stream, None), name, meta)
            extra = next(stream, None) if last else None
            if extra is not None:  # found before the last bucket is awaited
                raise ValueError(f"BucketedWeightSender.send: the tensors go on past their "
                                 f"layout ({len(layout)} entries): {extra[0]!r} was not "
                                 f"announced")

        for i, pairs in enumerate(planned):
            last = i == len(planned) - 1
            announced = Bucket.of(pairs, flattened=False, flush_cache=last)  # meta tensors
            yield replace(announced, tensors=drawn(pairs, last))

    def _start(self, bucket: Bucket, stats: SyncStats) -> Callable[[], None]:
        """Start sending ``bucket`` to every engine; return ``finish()``, which waits until
        every engine has loaded it (and raises :class:`EngineError` if one refused or the time
        ran out)."""
        if self.mode == "distributed":
            return self._start_broadcast(bucket, stats)
        return self._start_share(bucket, stats)

    def _start_broadcast(self, bucket: Bucket, stats: SyncStats) -> Callable[[], None]:
        """Announce the bucket (each engine allocates it and waits in the receive), then put
        each tensor on the wire as it comes."""
        answers = [e.submit(e.aio.update_weights_from_distributed(
                       bucket.names, bucket.dtypes, bucket.shapes, self.group_name,
                       flush_cache=bucket.flush_cache, load_format=bucket.load_format,
                       timeout=self.timeout))
                   for e in self.engines]
        sent, works = [], []  # the tensors live until their broadcast ends
        for tensor in bucket.tensors:
            sent.append(tensor)
            works.append(broadcast(tensor, self.group))
        stats.add(len(bucket.names), sum(t.nbytes for t in sent))

        def finish() -> None:
            self._await_broadcast(works, answers)
            _answered(answers)
            sent.clear()

        return finish

    def _await_broadcast(self, works, answers) -> None:
        """Wait until the broadcasts ``works`` are done; fail at once if an engine refused its
        update (``answers``: it never receives, so the broadcast would hang) or after
        ``timeout``."""
        deadline = time.monotonic() + self.timeout
        while not all(w.is_completed() for w in works):
            failed = [f for f in answers if f.done() and f.exception() is not None]
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

    def _start_share(self, bucket: Bucket, stats: SyncStats) -> Callable[[], None]:
        """Hand every engine TP rank its own pickle of the bucket's shared-memory handles."""
        pairs = list(zip(bucket.names, bucket.tensors))
        payload = engine_payload(pairs, flattened=self.load_format == "flattened_bucket")
        answers = [e.submit(e.aio.update_weights_from_tensor(
                       [pickle_for_receiver(payload) for _ in range(tp)],
                       load_format=self.load_format, flush_cache=bucket.flush_cache,
                       timeout=self.timeout))
                   for e, tp in zip(self.engines, self._tp_sizes())]
        stats.add(len(pairs), sum(t.nbytes for _, t in pairs))

        def finish(_keep_alive=payload) -> None:  # the tensors' shared memory lives until here
            _answered(answers)

        return finish


def send_export(export, sender: BucketedWeightSender | None, version: str | int, *,
                streamed: bool = True, before: Callable[[], None] | None = None
                ) -> SyncStats | None:
    """One rank's part in a weight sync whose tensors come from a collective export that every
    rank iterates to its end (``DirectExport``: the other ranks send their shards to the sending
    one). ``sender``: the sending rank's; None on the others. ``streamed``: the sender follows
    the export's ``layout``. ``before``: what the sending rank does first (take restarted
    engines into its channel), failing as the send would.

    A failed send (an engine died mid-sync, refused the update, or did not join the group) still
    draws and drops the rest of the export before raising: the other ranks are sending their
    shards to this one and would otherwise wait forever. So every rank returns, the error
    reaches the caller from the sending rank, and the run can restart the engines and sync
    again."""
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
    """Wait for every engine's answer to an update, raising the first failure at once: after an
    engine's death the others' answers wait for a broadcast that never completes."""
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
