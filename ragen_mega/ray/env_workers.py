"""Envs in Ray actors, so long-horizon runs step them on the cluster's CPUs, not in the driver,
where their steps would compete with the event loop that feeds the engines (docs/design.md, "Env
workers").

Each :class:`EnvWorker` hosts many envs keyed by episode id; the driver holds a
:class:`RemoteEnv` per episode, awaitable like ``rollout.episode.LocalEnv``. Episode ``i`` plays
on worker ``i % num_workers``: a step's episode ids are consecutive, so this balances the workers
and depends on the episode alone. A worker runs its calls one at a time (env steps are CPU-bound
Python: threads would gain nothing under the GIL); a failed call (the worker died, the env
raised) is re-raised as :class:`EnvWorkerError` naming the worker, the episode and the call.
"""
from __future__ import annotations

from typing import Any, Sequence

from ragen_mega.envs import make
from ragen_mega.ray.actor_group import ActorGroup
from ragen_mega.rollout.types import EpisodeSpec


class EnvWorkerError(RuntimeError):
    """An env call on a worker failed: the worker died, or the env raised."""


class EnvWorker:
    """Ray actor hosting the envs of the episodes assigned to it, keyed by episode id."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.envs: dict[int, Any] = {}

    def create(self, episode_id: int, name: str, kwargs: dict[str, Any]) -> tuple[str, list[str]]:
        """Make the episode's env; return what its prompt needs: instruction and valid actions."""
        if episode_id in self.envs:
            raise ValueError(f"env worker {self.rank} already hosts episode {episode_id}: two "
                             f"episodes with one id are playing at once")
        env = make(name, **kwargs)
        self.envs[episode_id] = env
        return env.instruction, list(env.valid_actions)

    def reset(self, episode_id: int, seed: int) -> str:
        return self._env(episode_id).reset(seed)

    def step(self, episode_id: int, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        return self._env(episode_id).step(action)

    def state_key(self, episode_id: int, observation: str) -> str:
        return self._env(episode_id).state_key(observation)

    def close(self, episode_id: int) -> None:
        env = self._env(episode_id)
        del self.envs[episode_id]  # first: an env whose close raises is gone all the same
        env.close()

    def hosted(self) -> list[int]:
        """Episode ids of the envs open here (an empty list once a rollout is over)."""
        return sorted(self.envs)

    def _env(self, episode_id: int):
        if episode_id not in self.envs:
            raise KeyError(f"env worker {self.rank} hosts no env of episode {episode_id} (never "
                           f"created, or closed); it hosts {sorted(self.envs)}")
        return self.envs[episode_id]


class RemoteEnv:
    """Driver-side handle of one episode's env on an :class:`EnvWorker`."""

    def __init__(self, worker, rank: int, spec: EpisodeSpec):
        self.worker, self.rank, self.spec = worker, rank, spec
        self.instruction, self.valid_actions = "", []

    async def create(self) -> "RemoteEnv":
        self.instruction, self.valid_actions = await self._call(
            "create", self.spec.env_name, self.spec.env_kwargs)
        return self

    async def reset(self, seed: int) -> str:
        return await self._call("reset", seed)

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        return await self._call("step", action)

    async def state_key(self, observation: str) -> str:
        return await self._call("state_key", observation)

    async def close(self) -> None:
        await self._call("close")

    async def _call(self, method: str, *args):
        import ray

        try:
            return await getattr(self.worker, method).remote(self.spec.episode_id, *args)
        except ray.exceptions.RayError as e:
            died = isinstance(e, ray.exceptions.RayActorError)
            cause = e if died else getattr(e, "cause", None) or e  # the env's own exception
            raise EnvWorkerError(
                f"env worker {self.rank} {'died' if died else 'raised'} during {method} of episode "
                f"{self.spec.episode_id} (env {self.spec.env_name!r}, seed {self.spec.seed}): "
                f"{type(cause).__name__}: {cause}") from e


class EnvWorkerGroup:
    """One env worker per bundle: worker ``i`` in bundle ``bundle_indices[i]`` of ``pg``."""

    def __init__(self, pg, bundle_indices: Sequence[int], *, num_cpus: float):
        if not bundle_indices:
            raise ValueError("EnvWorkerGroup: no bundles given; with rollout.env_workers=0 the "
                             "envs live in the driver and no group is needed")
        self.workers = ActorGroup(EnvWorker, pg, bundle_indices, num_cpus=num_cpus)

    def __len__(self) -> int:
        return len(self.workers)

    async def open(self, spec: EpisodeSpec) -> RemoteEnv:
        """The episode's env, made on worker ``spec.episode_id % len(self)`` (an ``OpenEnvFn``)."""
        rank = spec.episode_id % len(self.workers)
        return await RemoteEnv(self.workers.actors[rank], rank, spec).create()

    def kill(self) -> None:
        self.workers.kill()
