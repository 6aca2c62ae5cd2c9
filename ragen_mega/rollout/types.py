"""The types an episode's code and the engines' agree on: what a generation returns, the
generate and open-env callables, which episode to play (:class:`EpisodeSpec`), the env handle an
episode drives, and the exceptions that end or replay an episode. Kept apart from
``rollout/episode.py`` so the engine side (``ray/engine_group.py``) and the rollout side share
them without importing each other."""
from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Callable, Protocol

import torch


@dataclasses.dataclass
class Generation:
    """What an engine returns for one prompt: sampled ids and their log-probs (and, from the
    engines of a mixture of experts, the experts of every token but the last:
    ``routed_experts`` [prompt + output - 1, layers, top-k]). ``versions``: the weight version
    that sampled each id (a request a sync landed in has two; -1: the weights the server was
    started with, before any sync)."""
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str = ""
    routed_experts: torch.Tensor | None = None
    versions: list[int] | None = None


#: ``await generate(prompt_ids, sampling_params)`` -> :class:`Generation`
GenerateFn = Callable[[list[int], dict[str, Any]], Awaitable[Generation]]


class PromptTooLong(RuntimeError):
    """The engine refused a prompt longer than its context (a ``GenerateFn`` raises this; the
    episode then ends at that turn, truncated)."""


class EnvFailed(RuntimeError):
    """A user's env raised (at make, reset, step or close) while playing ``spec``'s episode."""

    def __init__(self, spec: EpisodeSpec, call: str, error: BaseException):
        self.spec, self.call, self.error = spec, call, error
        super().__init__(f"env {spec.env_name!r} (seed {spec.seed}, episode {spec.episode_id}) "
                         f"raised during {call}: {type(error).__name__}: {error}")


class EngineRestarted(RuntimeError):
    """The engine serving a request died and was restarted (``ray/engine_group.py``): the
    episode or window that sent it is replayed from its start
    (:func:`~ragen_mega.rollout.faults.replay_on_restart`). ``resynced``: the restarted engine
    has the trainer's weights already; False while resyncs are deferred
    (``EngineSupervisor.deferred``: a rollout beside training cannot give it weights). It then
    gets them at the next sync, so a rollout that sync waits for ends instead of waiting for it."""

    def __init__(self, message: str, *, resynced: bool = True):
        super().__init__(message)
        self.resynced = resynced


@dataclasses.dataclass
class EpisodeSpec:
    """Which episode to play: env, its kwargs and seed, and where it belongs."""
    env_name: str
    env_kwargs: dict[str, Any]
    seed: int
    episode_id: int
    group_id: int
    env_tag: str = ""
    max_turns: int | None = None   # this env's own turn limit (``env.mix[i].max_turns``)


class EnvHandle(Protocol):
    """What an episode needs of its env: the prompt's text (read before ``reset``, as
    :meth:`PromptBuilder.for_env` reads a :class:`TextEnv`'s) and awaitable game calls."""
    instruction: str
    valid_actions: list[str]

    async def reset(self, seed: int) -> str: ...

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]: ...

    async def state_key(self, observation: str) -> str: ...

    async def close(self) -> None: ...


#: ``await open_env(spec)`` -> a fresh :class:`EnvHandle` of ``spec``'s env
OpenEnvFn = Callable[[EpisodeSpec], Awaitable[EnvHandle]]


@dataclasses.dataclass
class DroppedEpisode:
    """An episode that gave nothing to train on: its env raised (``env_failed``), or its very
    first prompt was longer than the engine's context (``prompt_too_long``)."""
    spec: EpisodeSpec
    kind: str
    reason: str
