"""SGLang rollout engines placed by Ray, and the rollout's generate function over all of them.

Each :class:`EngineWorker` is a small Ray actor that starts one SGLang server on its node (the
server is the actor's child process group, so killing the actor's group stops it) and reports
its URL. The driver then talks to the servers directly over HTTP: generation never goes through
Ray's object store.

An engine with ``tp`` devices spans ``tp`` bundles, but a Ray actor can only take resources from
the one bundle it sits in, so the worker asks for no GPU and Ray gives it no
``CUDA_VISIBLE_DEVICES``. The group therefore finds each engine's GPUs first
(``ray/devices.py``) and the worker starts its server on exactly those.

An engine whose server dies during a rollout costs a retry, not the run: the request that meets
the dead server finds out (the worker says its server exited), the worker starts a new server on
the same bundle and devices, ``resync`` loads the current weights into it, and every episode
that was using it is played again from its start (:meth:`EngineGroup.replaying`). With seeded
sampling (``rollout/seeding.py``) the replay gives the same tokens, so the step's samples are
those of a run without the fault. At most ``max_restarts_per_step`` restarts between two
:meth:`EngineGroup.take_fault_counts`, then a clear error.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import secrets
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import torch

from ragen_mega.ray.actor_group import ActorGroup
from ragen_mega.rollout.types import (EngineRestarted, EpisodeSpec, Generation, OpenEnvFn,
                                      PromptTooLong)
from ragen_mega.rollout.episode import Episode

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


class ResyncDeferred(RuntimeError):
    """An engine restarted while resyncs were deferred (:meth:`EngineGroup.resyncs_deferred`):
    the rollout that met it ends, and is played again once the engine has the weights."""


def _server_args(ep: int, routed_experts) -> list[str]:
    """SGLang arguments of a mixture of experts' engines: expert parallelism, and each token's
    experts returned (routing replay)."""
    return ((["--ep-size", str(ep)] if ep > 1 else [])
            + (["--enable-return-routed-experts"] if routed_experts else []))


class EngineGroup:
    """``num_engines`` SGLang servers, engine ``e`` on the GPUs of ``bundles[e]`` (when the
    bundles hold GPUs); :meth:`generate` spreads requests over them.
    ``seeded_sampling``: the servers honour ``sampling_seed``; ``memory_saver`` (colocated runs):
    :meth:`release_memory` frees their GPU memory; ``mem_fraction``: SGLang's
    ``--mem-fraction-static`` (see ``backends/sglang/server.py``); ``max_restarts_per_step``:
    restarts of dead engines allowed between two :meth:`take_fault_counts`.
    ``ep``: SGLang's ``--ep-size`` (a mixture of experts' experts split over the engine's TP
    ranks). ``routed_experts`` (a mixture of experts: its ``(layers, top-k, experts)``): the
    servers record, and every generation returns, the experts each token was routed to
    (routing replay).
    ``resync({engine: url})``: loads the current weights into restarted engines (None: the
    engines serve ``model_path`` as it is, so a new server already has them)."""

    resync: Callable[[dict[int, str]], Any] | None = None

    def __init__(self, model_path: str, pg, bundles: list[list[int]], *, tp: int,
                 dtype: str | None, log_dir: str, num_cpus: float,
                 startup_timeout: float = 600.0, seeded_sampling: bool = False,
                 memory_saver: bool = False, mem_fraction: float | None = None,
                 max_restarts_per_step: int = 0, ep: int = 1,
                 routed_experts: tuple[int, int, int] | None = None):
        from ragen_mega.backends.sglang.client import AsyncEngineClient
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
                                                extra_args=_server_args(ep, routed_experts))))
        self.urls = self.group.call("url", timeout_s=startup_timeout)
        self.tp_sizes = [tp] * len(self.urls)
        self.clients = [AsyncEngineClient(u, api_key=self.api_key) for u in self.urls]
        self._next = itertools.cycle(range(len(self.clients)))
        self.log_dir, self.max_restarts_per_step = log_dir, max_restarts_per_step
        self.routed_shape = routed_experts
        self._lives = [0] * len(self.urls)  # restarts of each engine so far
        self._restart_lock = asyncio.Lock()  # renewed by run: a lock belongs to one event loop
        self._faults = self._no_faults()
        self._retired: list = []  # clients of replaced servers, closed at the end of run
        self._defer_resync = False
        self._unsynced: list[int] = []  # restarted while resyncs were deferred

    @staticmethod
    def _no_faults() -> dict[str, float]:
        return {"fault/engine_restarts": 0.0, "fault/episodes_retried": 0.0}

    def take_fault_counts(self) -> dict[str, float]:
        """Engine restarts and replayed episodes since the last call (which also renews the
        restart allowance): the step's ``fault/*`` metrics."""
        faults, self._faults = self._faults, self._no_faults()
        return faults

    async def generate(self, prompt_ids: list[int], sampling: dict[str, Any],
                       engine: int | None = None) -> Generation:
        """One completion (token ids and log-probs) from ``engine``, or the next one in turn.
        Raises :class:`EngineRestarted` if that engine died under the request and is back; a
        prompt the engine refuses as longer than its context raises
        :class:`~ragen_mega.rollout.types.PromptTooLong` (the episode ends there)."""
        from ragen_mega.backends.sglang.client import ContextLengthExceeded, EngineError

        engine = next(self._next) if engine is None else engine
        life = self._lives[engine]
        try:
            out = await self.clients[engine].generate(
                prompt_ids, sampling, return_logprob=True,
                return_routed_experts=self.routed_shape is not None)
        except ContextLengthExceeded as e:
            raise PromptTooLong(str(e)) from e
        except EngineError as e:
            await self._restart_if_dead(engine, life, e)
            raise EngineRestarted(f"engine {engine} died under a request and was restarted: "
                                  f"{e}") from e
        routed = None
        if self.routed_shape is not None:
            # one byte per expert id where it fits (128 experts: Qwen3-30B's 48 x 8 per token)
            dtype = torch.uint8 if self.routed_shape[2] <= 256 else torch.int16
            routed = torch.from_numpy(out.routed_experts.copy()).view(
                -1, *self.routed_shape[:2]).to(dtype)
        return Generation(out.output_ids, out.output_logprobs, out.finish_reason, routed)

    async def _restart_if_dead(self, engine: int, life: int, error: Exception) -> None:
        """Return once ``engine`` (which failed ``error`` in its ``life``-th life) is up again;
        re-raise ``error`` if its server is alive (the request itself was refused). The first
        request to fail restarts it, the others wait for that and find it restarted.

        The restarted engine gets the current weights through ``resync``, unless resyncs are
        deferred (:meth:`resyncs_deferred`): then :class:`ResyncDeferred` ends the rollout and
        the engine waits in :meth:`take_unsynced` for whoever holds the trainer."""
        async with self._restart_lock:
            if self._lives[engine] != life:
                return
            worker = self.group.actors[engine]
            if not await worker.server_exited.remote():
                raise error
            self._allow_restart(engine, error)
            self._replace_client(engine, await worker.restart.remote())
            if self.resync is None:
                return
            if self._defer_resync:
                self._unsynced.append(engine)
                raise ResyncDeferred(f"engine {engine} was restarted during an overlapped "
                                     f"rollout; it gets the trainer's weights at the join")
            # blocking Ray calls: off the loop the episodes run on
            await asyncio.to_thread(self.resync, {engine: self.urls[engine]})

    def restart_dead(self) -> dict[int, str]:
        """Restart every engine found dead between rollouts (its server process exited, or its
        HTTP server does not answer), counted as a rollout's restarts are; returns ``{engine:
        url}`` of the restarted ones, for the weight sync that follows to bring them to the
        trainer's weights (``Run.sync_weights``, on the thread that holds the trainer). Found
        here, only the dead engine is restarted; one that dies after this check fails the sync,
        and then every engine is (:meth:`restart_after_failed_sync`)."""
        import ray

        restarted = {}
        for engine in self._dead():
            self._allow_restart(engine, None)
            self._replace_client(engine, ray.get(self.group.actors[engine].restart.remote()))
            restarted[engine] = self.urls[engine]
        return restarted

    def restart_after_failed_sync(self, error: Exception) -> dict[int, str]:
        """A weight sync failed with ``error`` (every trainer rank has returned: the sending
        rank drains the export, ``send_export``). If an engine died during it, restart every
        engine and return ``{engine: url}`` of all of them, for ``Run.sync_weights`` to sync
        into through a new group. All of them: the dead ones cannot take part, and the others
        were left inside the broken update (waiting in a broadcast receive that never completes,
        which also keeps them from answering a request to leave the group). The dead ones count
        against the step's restart allowance; the others are counted in
        ``fault/engine_restarts`` but not limited. With no engine dead, ``error`` is re-raised:
        a refused update or a trainer's failure is not an engine's fault."""
        import ray

        dead = self._dead()
        if not dead:
            raise error
        for engine in dead:
            self._allow_restart(engine, error)
        self._faults["fault/engine_restarts"] += len(self.clients) - len(dead)
        urls = ray.get([worker.restart.remote() for worker in self.group.actors])
        for engine, url in enumerate(urls):
            self._replace_client(engine, url)
        return dict(enumerate(urls))

    def _dead(self) -> list[int]:
        """The engines whose server process exited or whose HTTP server does not answer."""
        import ray

        async def answering():
            return await asyncio.gather(*(c.health(timeout=30.0, generate=False)
                                          for c in self.clients))

        exited = ray.get([w.server_exited.remote() for w in self.group.actors])
        answers = self.run(answering())
        return [engine for engine, (gone, answers_http) in enumerate(zip(exited, answers))
                if gone or not answers_http]

    @contextlib.contextmanager
    def resyncs_deferred(self):
        """Within the block (an overlapped rollout on another thread, while the trainer
        trains), an engine restarted under a request is not given weights by ``resync`` (that
        would call the trainer from the rollout's thread, mid-update): the rollout ends with
        :class:`ResyncDeferred` and the engine waits in :meth:`take_unsynced` (the next weight
        sync, ``Run.sync_weights``, takes it)."""
        self._defer_resync = True
        try:
            yield
        finally:
            self._defer_resync = False

    def take_unsynced(self) -> dict[int, str]:
        """``{engine: url}`` of the engines restarted while resyncs were deferred, since the
        last call: they serve the checkpoint they loaded until given the trainer's weights."""
        unsynced, self._unsynced = self._unsynced, []
        return {e: self.urls[e] for e in unsynced}

    def _allow_restart(self, engine: int, error: Exception | None) -> None:
        """Count a restart of ``engine``, or raise once this step has had its allowance."""
        done = self._faults["fault/engine_restarts"]
        if done >= self.max_restarts_per_step:
            raise RuntimeError(
                f"engine {engine}'s SGLang server died (log {self.log_dir}/engine_{engine}.log) "
                f"and this step has already restarted {done:.0f} engine(s), the limit "
                f"(rollout.max_engine_restarts_per_step={self.max_restarts_per_step})") \
                from error
        self._faults["fault/engine_restarts"] += 1

    def _replace_client(self, engine: int, url: str) -> None:
        """Talk to ``engine``'s new server at ``url`` from now on (the old client's session is
        closed with the others at the end of the event loop it lives on: :meth:`run`)."""
        from ragen_mega.backends.sglang.client import AsyncEngineClient

        self._retired.append(self.clients[engine])
        self.clients[engine] = AsyncEngineClient(url, api_key=self.api_key)
        self.urls[engine] = url
        self._lives[engine] += 1

    def count_retried(self, episodes: int) -> None:
        """``episodes`` are played again after an engine restart (``fault/episodes_retried``)."""
        self._faults["fault/episodes_retried"] += episodes

    async def replaying(self, play: Callable[[OpenEnvFn | None], Awaitable[Episode]],
                        open_env: OpenEnvFn | None) -> Episode:
        """``await play(open_env)`` (one episode, its generate function made afresh each call),
        again from the start whenever an engine it used died and was restarted. The envs the
        abandoned attempt opened through ``open_env`` are closed first (the replay opens them
        anew; an env in the driver is simply dropped)."""
        while True:
            opened: list = []

            async def open_kept(spec: EpisodeSpec):
                opened.append(await open_env(spec))
                return opened[-1]

            try:
                return await play(None if open_env is None else open_kept)
            except EngineRestarted:
                self.count_retried(1)
                for env in opened:
                    await env.close()

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` (which talks to the engines, e.g. through :meth:`generate`) in a fresh
        event loop and return its result. The HTTP clients belong to the loop they were first
        used in, so they are closed before it ends, and the next call opens new ones."""
        async def run_then_close():
            self._restart_lock = asyncio.Lock()
            try:
                return await work
            finally:
                retired, self._retired = self._retired, []
                for client in self.clients + retired:
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
