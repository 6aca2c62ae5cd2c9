"""Multi-turn episodes against the engines, all of them concurrently.

Every episode is its own coroutine: it builds its prompt, awaits its own generation, steps its
own env and goes on, so an episode never waits for the slowest one of the batch (unlike a
lock-step "generate the whole batch, then step all envs" loop). An episode drives its env through
an async handle (:class:`EnvHandle`), so the same code plays an env in this process
(:class:`LocalEnv`; slow steps such as Crafter's in a worker thread, so the event loop keeps
feeding the engines) or in a Ray actor elsewhere in the cluster (``ray.env_workers``).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any, Awaitable, Callable, Protocol, Sequence

import torch

from ragen_mega.agent import AgentConfig, History, PromptBuilder, parse_response
from ragen_mega.envs import env_class, make
from ragen_mega.rollout.sample import Sample


@dataclasses.dataclass
class Generation:
    """What an engine returns for one prompt: sampled ids and their log-probs (and, from the
    engines of a mixture of experts, the experts of every token but the last:
    ``routed_experts`` [prompt + output - 1, layers, top-k])."""
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str = ""
    routed_experts: torch.Tensor | None = None


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
    """The engine serving a request died and was restarted (with the current weights): a
    ``GenerateFn`` raises this, and the episode (or window) that sent it is played again from its
    start (``ray/engine_group.py`` restarts; ``rollout/manager.py`` replays)."""


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


class LocalEnv:
    """A :class:`TextEnv` in this process as an :class:`EnvHandle`; ``in_thread`` runs its
    ``reset``/``step`` in a worker thread so a slow env does not stall the event loop."""

    def __init__(self, env, in_thread: bool = False):
        self.env, self.in_thread = env, in_thread
        self.instruction, self.valid_actions = env.instruction, env.valid_actions

    async def reset(self, seed: int) -> str:
        return await self._call(self.env.reset, seed)

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        return await self._call(self.env.step, action)

    async def state_key(self, observation: str) -> str:
        return self.env.state_key(observation)

    async def close(self) -> None:
        self.env.close()

    async def _call(self, method, arg):
        return await asyncio.to_thread(method, arg) if self.in_thread else method(arg)


@dataclasses.dataclass
class Episode:
    samples: list[Sample]
    #: success, reward, num_actions, valid/effective action rates, prompt_too_long (1: ended
    #: early because a prompt outgrew the engine's context)
    metrics: dict[str, float]


@dataclasses.dataclass
class EpisodeState:
    """One episode between two of its turns: its env, prompt state and running tallies.

    :func:`take_turn` advances it by one turn; :func:`run_episode` plays it to its end in one go,
    and the env streams of ``rollout/streams.py`` carry it over training steps, so both play
    exactly the same turns."""
    spec: EpisodeSpec
    env: EnvHandle
    builder: PromptBuilder
    history: History
    obs: str                    # the observation the next turn acts on
    max_turns: int
    turn: int = 0               # turns played so far
    done: bool = False
    success: bool = False
    reward: float = 0.0
    n_actions: int = 0
    n_valid: int = 0
    n_effective: int = 0
    n_format_ok: int = 0
    n_copied: int = 0           # turns whose answer is exactly the prompt's example answer
    too_long: bool = False      # ended because the next prompt outgrew the engine's context

    @property
    def over(self) -> bool:
        """Ended by the env, at its turn limit or by a prompt too long for the engine (both
        truncations: terminal, as RAGEN treats a turn limit)."""
        return self.done or self.too_long or self.turn >= self.max_turns

    def observe(self, history: History, agent: AgentConfig) -> None:
        """Start the next turn in ``history`` with the current observation."""
        history.observe(self.obs,
                        actions_left=(self.max_turns - self.turn) * agent.max_actions_per_turn)

    def next_prompt_ids(self, agent: AgentConfig) -> list[int]:
        """The prompt the next turn would be given, built without starting that turn (the
        state after a cut, for the critic to value)."""
        ahead = History()
        ahead.turns = list(self.history.turns)
        self.observe(ahead, agent)
        return self.builder.build(ahead).ids

    def metrics(self) -> dict[str, float]:
        n = self.n_actions
        return {"success": float(self.success), "reward": self.reward,
                "num_turns": float(self.turn), "num_actions": float(n),
                "valid_action_rate": self.n_valid / n if n else 0.0,
                "effective_action_rate": self.n_effective / n if n else 0.0,
                "format_ok_rate": self.n_format_ok / self.turn if self.turn else 0.0,
                "example_copy_rate": self.n_copied / self.turn if self.turn else 0.0,
                "prompt_too_long": float(self.too_long)}


async def open_env_handle(spec: EpisodeSpec, open_env: OpenEnvFn | None = None,
                          env_steps_in_thread: bool = False) -> EnvHandle:
    """A fresh env of ``spec`` (not reset): from ``open_env`` (an env worker or server), or
    made in this process (stepped in a thread with ``env_steps_in_thread``)."""
    async def open_local(spec):
        return LocalEnv(make(spec.env_name, **spec.env_kwargs), env_steps_in_thread)

    return await env_call(spec, "make", open_env or open_local, spec)


async def open_episode(spec: EpisodeSpec, *, tokenizer, agent: AgentConfig, max_turns: int,
                       env_steps_in_thread: bool = False,
                       open_env: OpenEnvFn | None = None) -> EpisodeState:
    """Open the episode's env (``open_env``, e.g. ``EnvWorkerGroup.open`` for a remote env, or
    by default made here, stepped in a thread with ``env_steps_in_thread``) and reset it."""
    env = await open_env_handle(spec, open_env, env_steps_in_thread)
    try:
        builder = PromptBuilder.for_env(tokenizer, agent, env)
        obs = await env_call(spec, "reset", env.reset, spec.seed)
    except BaseException:
        with contextlib.suppress(Exception):  # the reset's error is the one to see
            await env.close()
        raise
    return EpisodeState(spec, env, builder, History(), obs, spec.max_turns or max_turns)


async def take_turn(state: EpisodeState, *, tokenizer, agent: AgentConfig, generate: GenerateFn,
                    sampling: dict[str, Any]) -> Sample:
    """One turn: prompt from the history, one generation, its actions stepped in the env until
    one ends the episode; returns the turn's :class:`Sample` (``last`` set if the episode is
    now over)."""
    spec = state.spec
    state.observe(state.history, agent)
    prompt = state.builder.build(state.history)
    state_key = await env_call(spec, "state_key", state.env.state_key, state.obs)
    gen = await generate(prompt.ids, sampling)
    parsed = parse_response(tokenizer.decode(gen.output_ids, skip_special_tokens=True), agent,
                            finished=gen.finish_reason == "stop")
    reward, all_valid = 0.0, True
    for action in parsed.actions:
        state.obs, r, state.done, info = await env_call(spec, "step", state.env.step, action)
        reward += float(r)
        state.n_actions += 1
        all_valid &= bool(info.get("action_is_valid"))
        state.n_valid += bool(info.get("action_is_valid"))
        state.n_effective += bool(info.get("action_is_effective"))
        state.success = state.success or bool(info.get("success"))
        if state.done:
            break
    if not parsed.format_ok or not all_valid:  # RAGEN: a broken format or an unknown action
        reward += agent.format_penalty
    state.turn += 1
    state.reward += reward
    state.n_format_ok += parsed.format_ok
    state.n_copied += state.builder.copies_example(parsed.actions)
    state.history.record(gen.output_ids, parsed, reward)
    return Sample(
        prompt_ids=prompt.ids, response_ids=list(gen.output_ids),
        rollout_logprobs=list(gen.logprobs), reward=reward, episode_id=spec.episode_id,
        group_id=spec.group_id, turn=state.turn, done=state.done, last=state.over,
        env_tag=spec.env_tag or spec.env_name, seed=spec.seed,
        info={"format_ok": parsed.format_ok, "finish_reason": gen.finish_reason},
        state_key=state_key, routed_experts=gen.routed_experts)


async def run_episode(spec: EpisodeSpec, *, tokenizer, agent: AgentConfig, generate: GenerateFn,
                      sampling: dict[str, Any], max_turns: int,
                      env_steps_in_thread: bool = False,
                      open_env: OpenEnvFn | None = None) -> Episode:
    """Play one episode to its end or its turn limit (``spec.max_turns``, else ``max_turns``); one
    :class:`Sample` per turn. The env comes from ``open_env`` (e.g. ``EnvWorkerGroup.open``: a
    remote env), or by default is made here (stepped in a thread with ``env_steps_in_thread``).
    An env that raises raises :class:`EnvFailed`; a prompt the engine refuses as too long
    (``generate`` raises :class:`PromptTooLong`) ends the episode before that turn (no turn at
    all: an episode without samples, which the step drops)."""
    state = await open_episode(spec, tokenizer=tokenizer, agent=agent, max_turns=max_turns,
                               env_steps_in_thread=env_steps_in_thread, open_env=open_env)
    samples: list[Sample] = []
    try:
        while not state.over:
            try:
                samples.append(await take_turn(state, tokenizer=tokenizer, agent=agent,
                                               generate=generate, sampling=sampling))
            except PromptTooLong:  # truncated here, like a turn limit
                state.too_long = True
    except BaseException:
        with contextlib.suppress(Exception):  # the error that ended the episode is the one to see
            await state.env.close()
        raise
    await env_call(spec, "close", state.env.close)
    if not samples:
        return Episode([], {"prompt_too_long": 1.0})
    samples[-1].last = True
    return Episode(samples, state.metrics())


async def env_call(spec: EpisodeSpec, call: str, fn, *args):
    """``await fn(*args)``, an env's exception raised as :class:`EnvFailed` (the episode is
    dropped, the step goes on: ``rollout/faults.py``)."""
    try:
        return await fn(*args)
    except Exception as e:  # noqa: BLE001 - a user's env may raise anything
        raise EnvFailed(spec, call, e) from e


def group_specs(env_name: str, env_kwargs: dict[str, Any], *, env_groups: int, group_size: int,
                first_seed: int, env_tag: str = "", first_group: int = 0,
                max_turns: int | None = None) -> list[EpisodeSpec]:
    """RAGEN's grouping: ``env_groups`` groups of ``group_size`` episodes. Group ``g`` plays seed
    ``first_seed + g`` in every episode, unless the env's ``seed_shared_in_group`` is False; then
    episode ``i`` plays seed ``first_seed + i`` (the seed range used is the same size either way:
    :func:`seeds_per_step`). Group ids start at ``first_group`` (episode ids follow them), so the
    groups of several envs in one step stay distinct (:func:`mix_specs`). ``max_turns``: the
    env's own turn limit (None: the run's)."""
    shared = env_class(env_name).seed_shared_in_group
    return [EpisodeSpec(env_name, dict(env_kwargs),
                        first_seed + (g if shared else g * group_size + k),
                        (first_group + g) * group_size + k, first_group + g, env_tag, max_turns)
            for g in range(env_groups) for k in range(group_size)]


def seeds_per_step(env_name: str, env_groups: int, group_size: int) -> int:
    """How many consecutive seeds one call of :func:`group_specs` uses."""
    return env_groups if env_class(env_name).seed_shared_in_group else env_groups * group_size


@dataclasses.dataclass(frozen=True)
class EnvPart:
    """One env of a step's mix (RAGEN's ``env_configs`` tag with its ``n_groups``): episodes of
    env ``name`` built with ``kwargs``, ``groups`` groups of them, metrics logged under ``tag``,
    at most ``max_turns`` turns each (None: the run's ``env.max_turns``)."""
    tag: str
    name: str
    kwargs: dict[str, Any]
    groups: int
    max_turns: int | None = None


def train_parts(env) -> list[EnvPart]:
    """The envs of one training step, in order, from the run's ``env`` section: its ``mix``
    entries that train (``env_groups`` > 0), or the one env ``name`` with ``kwargs``."""
    if not env.mix:
        return [EnvPart(env.name, env.name, env.kwargs, env.env_groups)]
    return [EnvPart(m.tag, m.env_name, m.kwargs, m.env_groups, m.max_turns) for m in env.mix
            if m.env_groups > 0]


def val_parts(env) -> list[EnvPart]:
    """The envs of the held-out evaluation (groups of ``env.val_group_size`` episodes), in
    order: each ``mix`` entry with held-out groups, or ``val_name`` (default: the training env)
    with ``val_kwargs`` (default: the training kwargs, for the training env only)."""
    if not env.mix:
        name = env.val_name or env.name
        kwargs = env.val_kwargs or (env.kwargs if name == env.name else {})
        return [EnvPart(name, name, kwargs, env.val_groups)]
    groups = [env.val_groups if m.val_groups is None else m.val_groups for m in env.mix]
    return [EnvPart(m.tag, m.env_name, m.kwargs, g, m.max_turns)
            for m, g in zip(env.mix, groups) if g]


def mix_seeds_per_step(parts: Sequence[EnvPart], group_size: int) -> int:
    """How many consecutive seeds one call of :func:`mix_specs` uses: the parts' ranges end to end."""
    return sum(seeds_per_step(p.name, p.groups, group_size) for p in parts)


def mix_specs(parts: Sequence[EnvPart], *, group_size: int, first_seed: int) -> list[EpisodeSpec]:
    """The episodes of one step over several envs: :func:`group_specs` for each part in order,
    each part on its own seed range right after the previous part's (no two envs share a seed,
    and the whole step spans :func:`mix_seeds_per_step` seeds, so step k's seeds stay a function
    of k), group ids numbered on across parts. One part is exactly :func:`group_specs`."""
    specs: list[EpisodeSpec] = []
    first_group = 0
    for p in parts:
        specs += group_specs(p.name, p.kwargs, env_groups=p.groups, group_size=group_size,
                             first_seed=first_seed, env_tag=p.tag, first_group=first_group,
                             max_turns=p.max_turns)
        first_seed += seeds_per_step(p.name, p.groups, group_size)
        first_group += p.groups
    return specs


def train_step_specs(parts: Sequence[EnvPart], *, group_size: int, seed: int, step: int
                     ) -> list[EpisodeSpec]:
    """Training step ``step``'s (1-based) episodes: its seeds follow step ``step - 1``'s, so they
    are a function of the step alone (a resumed run replays exactly the uninterrupted one)."""
    first = seed + (step - 1) * mix_seeds_per_step(parts, group_size)
    return mix_specs(parts, group_size=group_size, first_seed=first)
