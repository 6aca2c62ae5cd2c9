"""SGLang rollout engines placed by Ray, and the rollout's generate function over all of them.

Each :class:`EngineWorker` is a small Ray actor that starts one SGLang server on its node (the
server is the actor's child process group, so killing the actor's group stops it) and reports
its URL. The driver then talks to the servers directly over HTTP: generation never goes through
Ray's object store.

An engine with ``tp`` devices spans ``tp`` bundles, but a Ray actor can only take resources from
the one bundle it sits in, so the worker asks for no GPU and Ray gives it no
``CUDA_VISIBLE_DEVICES``. The group therefore finds each engine's GPUs first
(``ray/devices.py``) and the worker starts its server on exactly those.
"""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from typing import Any, TypeVar

from ragen_mega.ray.actor_group import ActorGroup
from ragen_mega.rollout.episode import Generation
from ragen_mega.rollout.faults import PromptTooLong

T = TypeVar("T")


class EngineWorker:
    """Owns one SGLang server process on the node Ray put this actor on."""

    def __init__(self, rank: int, world: int, model_path: str, log_dir: str,
                 startup_timeout: float, gpu_ids: list[list[str] | None], server_kwargs: dict):
        import ray

        from ragen_mega.backends.sglang.server import launch_server

        host = ray.util.get_node_ip_address()
        self.server = launch_server(model_path, host=host, log_file=f"{log_dir}/engine_{rank}.log",
                                    startup_timeout=startup_timeout, gpu_ids=gpu_ids[rank],
                                    **server_kwargs)

    def url(self) -> str:
        return self.server.url

    def shutdown(self) -> None:
        self.server.shutdown()


class EngineGroup:
    """``num_engines`` SGLang servers, engine ``e`` on the GPUs of ``bundles[e]`` (when the
    bundles hold GPUs); :meth:`generate` spreads requests over them.
    ``seeded_sampling``: the servers honour ``sampling_seed``; ``memory_saver`` (colocated runs):
    :meth:`release_memory` frees their GPU memory; ``mem_fraction``: SGLang's
    ``--mem-fraction-static`` (see ``backends/sglang/server.py``)."""

    def __init__(self, model_path: str, pg, bundles: list[list[int]], *, tp: int,
                 dtype: str | None, log_dir: str, num_cpus: float,
                 startup_timeout: float = 600.0, seeded_sampling: bool = False,
                 memory_saver: bool = False, mem_fraction: float | None = None):
        from ragen_mega.backends.sglang.client import AsyncEngineClient
        from ragen_mega.ray.devices import bundle_gpu_ids

        gpu_ids = [bundle_gpu_ids(pg, b, what=f"engine {e}") for e, b in enumerate(bundles)]
        # An engine spanning several devices sits on its first bundle; the others stay reserved.
        self.group = ActorGroup(EngineWorker, pg, [b[0] for b in bundles], num_cpus=num_cpus,
                                init_args=(model_path, log_dir, startup_timeout, gpu_ids,
                                           dict(tp=tp, dtype=dtype, mem_fraction=mem_fraction,
                                                seeded_sampling=seeded_sampling,
                                                memory_saver=memory_saver)))
        self.urls = self.group.call("url", timeout_s=startup_timeout)
        self.tp_sizes = [tp] * len(self.urls)
        self.clients = [AsyncEngineClient(u) for u in self.urls]
        self._next = itertools.cycle(range(len(self.clients)))

    async def generate(self, prompt_ids: list[int], sampling: dict[str, Any],
                       engine: int | None = None) -> Generation:
        """One completion (token ids and log-probs) from ``engine``, or the next one in turn.
        A prompt the engine refuses as longer than its context raises
        :class:`~ragen_mega.rollout.faults.PromptTooLong` (the episode ends there)."""
        from ragen_mega.backends.sglang.client import ContextLengthExceeded

        client = self.clients[next(self._next) if engine is None else engine]
        try:
            out = await client.generate(prompt_ids, sampling, return_logprob=True)
        except ContextLengthExceeded as e:
            raise PromptTooLong(str(e)) from e
        return Generation(out.output_ids, out.output_logprobs, out.finish_reason)

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` (which talks to the engines, e.g. through :meth:`generate`) in a fresh
        event loop and return its result. The HTTP clients belong to the loop they were first
        used in, so they are closed before it ends, and the next call opens new ones."""
        async def run_then_close():
            try:
                return await work
            finally:
                for client in self.clients:
                    await client.close()

        return asyncio.run(run_then_close())

    def release_memory(self) -> None:
        """Colocated mode: every engine frees its weights and KV cache for the trainer's phase
        (GPU memory with ``--enable-memory-saver``; on CPU SGLang keeps the memory and only runs
        the protocol: flush, stash its static buffers)."""
        self._on_all("release_memory_occupation")

    def resume_memory(self, tags: list[str]) -> None:
        """Colocated mode: take memory back, ``["weights"]`` before a weight sync and
        ``["kv_cache"]`` after it (slime's order: the cache is not needed while weights load)."""
        self._on_all("resume_memory_occupation", tags)

    def _on_all(self, method: str, *args) -> None:
        async def call_all():
            await asyncio.gather(*(getattr(c, method)(*args) for c in self.clients))

        self.run(call_all())

    def shutdown(self) -> None:
        self.group.call("shutdown")
        self.group.kill()
