"""SGLang rollout engines placed by Ray, and the rollout's generate function over all of them.

Each :class:`EngineWorker` is a small Ray actor that starts one SGLang server on its node (its
child process group) and reports its URL; the driver then talks to the servers over HTTP, never
through Ray's object store. The worker asks Ray for no GPU: the server starts on the GPUs
``ray/devices.py`` finds. A request that meets a dead server raises
:class:`~ragen_mega.rollout.types.EngineRestarted` once the group's
:class:`~ragen_mega.ray.engine_supervisor.EngineSupervisor` has restarted it with the current
weights, and the rollout manager plays the episodes that used it again (docs/design.md, "A dead
engine, a dead driver").
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import secrets
import threading
import warnings
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ragen_mega import progress
from ragen_mega.ray.actor_group import ActorGroup, gather
from ragen_mega.ray.engine_supervisor import EngineSupervisor
from ragen_mega.rollout.types import EngineRestarted, Generation, PromptTooLong

if TYPE_CHECKING:
    from ragen_mega.ray.weight_channel import TrainerWeights

T = TypeVar("T")


class EngineWorker:
    """Owns one SGLang server process on the node Ray put this actor on."""

    def __init__(self, rank: int, world: int, model_path: str, log_dir: str,
                 startup_timeout: float, gpu_ids: list[list[str] | None], server_kwargs: dict):
        import ray

        from ragen_mega.backends.sglang.server import launch_server

        host = ray.util.get_node_ip_address()
        self.launch = functools.partial(
            launch_server, model_path, host=host, log_file=f"{log_dir}/engine_{rank}.log",
            startup_timeout=startup_timeout, gpu_ids=gpu_ids[rank], **server_kwargs)
        self.server = self.launch()

    def url(self) -> str:
        return self.server.url

    def server_exited(self) -> bool:
        return self.server.process.poll() is not None

    def restart(self) -> str:
        """Stop what is left of the server's process group, start a new server with the same
        settings (same devices, same log file); return its URL."""
        self.server.shutdown()
        self.server = self.launch()
        return self.server.url

    def shutdown(self) -> None:
        self.server.shutdown()


def _server_args(ep: int, routed_experts) -> list[str]:
    """SGLang arguments of a mixture of experts' engines: expert parallelism, and each token's
    experts returned (routing replay)."""
    return ((["--ep-size", str(ep)] if ep > 1 else [])
            + (["--enable-return-routed-experts"] if routed_experts else []))


class EngineGroup:
    """``num_engines`` SGLang servers, engine ``e`` on the GPUs of ``bundles[e]`` (when the
    bundles hold GPUs); :meth:`generate` spreads requests over them.

    ``seeded_sampling``: the servers honour ``sampling_seed``. ``memory_saver`` (colocated: the
    engines share the trainer's devices): :meth:`release_memory` and :meth:`resume_memory` hand
    the memory over and back (no-ops otherwise). ``mem_fraction``: SGLang's
    ``--mem-fraction-static``. ``max_restarts_per_step``: restarts of dead engines allowed
    between two ``supervisor.take_fault_counts()``. ``ep``: SGLang's ``--ep-size`` (the experts
    split over the engine's TP ranks). ``routed_experts`` (a mixture of experts' ``(layers,
    top-k, experts)``): every generation returns the experts each token was routed to (routing
    replay). ``lora_targets``: the servers merge the adapters each sync sends into those
    modules (``backends/sglang/lora_merge.py``). ``lora_serving`` ((rank, target modules);
    ``backends/sglang/lora_serving.py``): each request names :attr:`adapter`, the version the
    last sync loaded, and its tokens carry that version. ``batch_requests``: the requests of one
    event-loop pass go to each engine as one batch (``backends/sglang/request_batcher.py``).
    ``weights`` (:class:`~ragen_mega.ray.weight_channel.TrainerWeights`): brings restarted
    engines to the served weights (None: the engines serve ``model_path`` as it is, so a new
    server already has them). :attr:`supervisor`
    finds, restarts and resyncs dead engines, and describes each restart in ``fault_log``."""

    def __init__(self, model_path: str, pg, bundles: list[list[int]], *, tp: int,
                 dtype: str | None, log_dir: str, num_cpus: float,
                 startup_timeout: float = 600.0, seeded_sampling: bool = False,
                 memory_saver: bool = False, mem_fraction: float | None = None,
                 max_restarts_per_step: int = 0, ep: int = 1,
                 routed_experts: tuple[int, int, int] | None = None,
                 weights: TrainerWeights | None = None,
                 fault_log: str | Path | None = None, lora_targets: tuple[str, ...] = (),
                 lora_serving: tuple[int, tuple[str, ...]] | None = None,
                 batch_requests: bool = False):
        from ragen_mega.backends.sglang.client import AsyncEngineClient
        from ragen_mega.backends.sglang.request_batcher import RequestBatcher
        from ragen_mega.ray.devices import bundle_gpu_ids

        #: the run's engine key: each server answers only requests that carry it (never logged)
        self.api_key = secrets.token_urlsafe(32)
        gpu_ids = [bundle_gpu_ids(pg, b, what=f"engine {e}") for e, b in enumerate(bundles)]
        # An engine spanning several devices sits on its first bundle; the others stay reserved.
        self.group = ActorGroup(EngineWorker, pg, [b[0] for b in bundles], num_cpus=num_cpus,
                                init_args=(model_path, log_dir, startup_timeout, gpu_ids,
                                           dict(tp=tp, dtype=dtype, mem_fraction=mem_fraction,
                                                seeded_sampling=seeded_sampling,
                                                memory_saver=memory_saver,
                                                api_key=self.api_key,
                                                lora_targets=lora_targets,
                                                lora_serving=lora_serving,
                                                extra_args=_server_args(ep, routed_experts))))
        #: (name, version) of the adapter requests use (None: the base weights)
        self.adapter: tuple[str, int] | None = None
        self.memory_saver = memory_saver
        refs = self.group.call_async("url")
        progress.count_ready(refs, "engines", timeout_s=startup_timeout)
        self.urls = gather(refs, what="url", timeout_s=startup_timeout)
        self.tp_sizes = [tp] * len(self.urls)
        self.clients = [AsyncEngineClient(u, api_key=self.api_key) for u in self.urls]
        self._next = itertools.cycle(range(len(self.clients)))
        self.routed_shape = routed_experts
        self._batcher = RequestBatcher(self._send) if batch_requests else None
        self._retired: list = []  # clients of replaced servers, closed at the end of run
        #: the loop (and its thread) of serve_forever while it runs
        self._resident: asyncio.AbstractEventLoop | None = None
        self._resident_thread: threading.Thread | None = None
        self.supervisor = EngineSupervisor(
            self.group.actors, self.urls, api_key=self.api_key, log_dir=log_dir,
            max_restarts_per_step=max_restarts_per_step, connect=self._replace_client,
            weights=weights, fault_log=fault_log)

    async def generate(self, prompt_ids: list[int], sampling: dict[str, Any],
                       engine: int | None = None) -> Generation:
        """One completion (token ids and log-probs) from ``engine``, or the next one in turn.
        Raises :class:`EngineRestarted` if that engine died under the request and is back; a
        prompt the engine refuses as longer than its context raises
        :class:`~ragen_mega.rollout.types.PromptTooLong` (the episode ends there)."""
        from ragen_mega.backends.sglang.client import ContextLengthExceeded, EngineError

        engine = await self._serving_engine() if engine is None else engine
        life = self.supervisor.lives[engine]
        adapter = self.adapter   # a sync may change it meanwhile: this request keeps its own
        lora_path = adapter[0] if adapter else None
        send = self._send if self._batcher is None else self._batcher.generate
        try:
            out = await send((engine, lora_path), prompt_ids, sampling)
        except ContextLengthExceeded as e:
            raise PromptTooLong(str(e)) from e
        except EngineError as e:  # blocking Ray calls: off the loop the episodes run on
            resynced = await asyncio.to_thread(self.supervisor.after_request_failed, engine,
                                               life, e)
            raise EngineRestarted(f"engine {engine} died under a request and was restarted"
                                  f"{'' if resynced else ' (its weights at the next sync)'}: "
                                  f"{e}", resynced=resynced) from e
        routed = None
        if self.routed_shape is not None:
            # one byte per expert id where it fits (128 experts: Qwen3-30B's 48 x 8 per token)
            dtype = torch.uint8 if self.routed_shape[2] <= 256 else torch.int16
            routed = torch.from_numpy(out.routed_experts.copy()).view(
                -1, *self.routed_shape[:2]).to(dtype)
        versions = ([adapter[1]] * len(out.output_ids) if adapter else
                    [int(v) if v.isdigit() else -1 for v in out.token_versions])
        return Generation(out.output_ids, out.output_logprobs, out.finish_reason, routed,
                          versions)

    async def _send(self, key: tuple[int, str | None], prompts: list[int] | list[list[int]],
                    samplings: dict | list[dict]):
        """One request to engine ``key[0]`` with adapter ``key[1]``: a prompt, or a batch of
        them (:class:`RequestBatcher`'s ``send``)."""
        engine, lora_path = key
        return await self.clients[engine].generate(
            prompts, samplings, return_logprob=True,
            return_routed_experts=self.routed_shape is not None, lora_path=lora_path)

    async def _serving_engine(self) -> int:
        """The next engine in turn that serves the trainer's weights: one restarted under a
        rollout that plays on (``EngineSupervisor.unsynced``) is passed over until a sync has
        given it them, and with none left the request waits for that sync."""
        while True:
            unsynced = self.supervisor.unsynced
            for _ in range(len(self.clients)):
                engine = next(self._next)
                if engine not in unsynced:
                    return engine
            await asyncio.sleep(0.05)

    def _replace_client(self, engine: int, url: str) -> None:
        """Talk to ``engine``'s new server at ``url`` from now on (the old client's session is
        closed with the others at the end of the event loop it lives on: :meth:`run`)."""
        from ragen_mega.backends.sglang.client import AsyncEngineClient

        self._retired.append(self.clients[engine])
        self.clients[engine] = AsyncEngineClient(url, api_key=self.api_key)

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` (which talks to the engines, e.g. through :meth:`generate`) in a fresh
        event loop and return its result. The HTTP clients belong to the loop they were first
        used in, so they are closed before it ends and the next call opens new ones. While
        :meth:`serve_forever` holds the clients on another thread's loop (``trainer.async_mode:
        fully``), ``work`` runs on that loop instead."""
        resident = self._resident
        if resident is not None and threading.current_thread() is not self._resident_thread:
            return asyncio.run_coroutine_threadsafe(work, resident).result()
        return asyncio.run(self._closing_clients(work))

    def serve_forever(self, work: Coroutine[Any, Any, T]) -> T:
        """:meth:`run` for ``work`` that plays as long as the run does, on this thread (a
        rollout thread's): until it returns, other threads' :meth:`run` calls join its loop."""
        async def resident():
            self._resident, self._resident_thread = asyncio.get_running_loop(), \
                threading.current_thread()
            try:
                return await self._closing_clients(work)
            finally:
                self._resident = self._resident_thread = None
        return asyncio.run(resident())

    async def _closing_clients(self, work: Coroutine[Any, Any, T]) -> T:
        try:
            return await work
        finally:
            retired, self._retired = self._retired, []
            for client in self.clients + retired:
                await client.close()

    @contextlib.contextmanager
    def generation_paused(self) -> Iterator[None]:
        """Requests in flight wait while the block runs (a weight sync under a running
        rollout): SGLang retracts them to its queue at a token boundary, and after the block
        they continue with the new weights, their earlier tokens' KV cache recomputed (slime's
        and AReaL's partial rollouts); ``Generation.versions`` says which weights sampled each
        token. The pause and continue use clients of their own (the rollout's belong to its
        loop)."""
        from ragen_mega.backends.sglang.client import EngineClient

        clients = [EngineClient(c.url, api_key=self.api_key) for c in self.clients]
        try:
            for client in clients:
                client.pause_generation("retract")
            yield
        finally:
            for client in clients:
                try:
                    client.continue_generation()
                except Exception as e:  # noqa: BLE001 - a dead engine: its requests fail alone
                    warnings.warn(f"could not continue generation on {client.url}: {e}")
                client.close()

    def release_memory(self) -> None:
        """Colocated engines free their weights and KV cache for the trainer's phase (GPU memory
        with ``--enable-memory-saver``; on CPU SGLang keeps the memory and only runs the
        protocol: flush, stash its static buffers). Engines on devices of their own: nothing."""
        if self.memory_saver:
            self._on_all("release_memory_occupation")

    def resume_memory(self, tags: list[str]) -> None:
        """Colocated engines take memory back: ``["weights"]`` before a weight sync and
        ``["kv_cache"]`` after it (slime's order: the cache is not needed while weights load).
        Engines on devices of their own: nothing."""
        if self.memory_saver:
            self._on_all("resume_memory_occupation", tags)

    def _on_all(self, method: str, *args) -> None:
        async def call_all():
            await asyncio.gather(*(getattr(c, method)(*args) for c in self.clients))

        self.run(call_all())

    def shutdown(self) -> None:
        self.group.call("shutdown")
        self.group.kill()
