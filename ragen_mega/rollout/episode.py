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

from ragen_mega.agent import AgentConfig, History, PromptBuilder, parse_response
from ragen_mega.envs import env_class, make
from ragen_mega.rollout.faults import EnvFailed, PromptTooLong
from ragen_mega.rollout.sample import Sample


@dataclasses.dataclass
class Generation:
    """What an engine returns for one prompt: sampled ids and their log-probs."""
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str = ""


#: ``await generate(prompt_ids, sampling_params)`` -> :class:`Generation`
GenerateFn = Callable[[list[int], dict[str, Any]], Awaitable[Generation]]


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


async def run_episode(spec: EpisodeSpec, *, tokenizer, agent: AgentConfig, generate: GenerateFn,
                      sampling: dict[str, Any], max_turns: int,
                      env_steps_in_thread: bool = False,
                      open_env: OpenEnvFn | None = None) -> Episode:
    """Play one episode to its end or its turn limit (``spec.max_turns``, else ``max_turns``); one
    :class:`Sample` per turn. The env comes from ``open_env`` (e.g. ``EnvWorkerGroup.open``: a
    remote env), or by default is made here (stepped in a thread with ``env_steps_in_thread``).
    An env that raises raises :class:`EnvFailed`; a prompt the engine refuses as too long
    (``generate`` raises :class:`PromptTooLong`) ends the episode before that turn."""
    max_turns = spec.max_turns or max_turns

    async def open_local(spec):
        return LocalEnv(make(spec.env_name, **spec.env_kwargs), env_steps_in_thread)

    env = await _env_call(spec, "make", open_env or open_local, spec)
    try:
        episode = await _play(spec, env, tokenizer, agent, generate, sampling, max_turns)
    except BaseException:
        with contextlib.suppress(Exception):  # the error that ended the episode is the one to see
            await env.close()
        raise
    await _env_call(spec, "close", env.close)
    return episode


async def _env_call(spec: EpisodeSpec, call: str, fn, *args):
    """``await fn(*args)``, an env's exception raised as :class:`EnvFailed` (the episode is
    dropped, the step goes on: ``rollout/faults.py``)."""
    try:
        return await fn(*args)
    except Exception as e:  # noqa: BLE001 - a user's env may raise anything
        raise EnvFailed(spec, call, e) from e


async def _play(spec: EpisodeSpec, env: EnvHandle, tokenizer, agent: AgentConfig,
                generate: GenerateFn, sampling: dict[str, Any], max_turns: int) -> Episode:
    builder = PromptBuilder.for_env(tokenizer, agent, env)
    history = History()
    obs = await _env_call(spec, "reset", env.reset, spec.seed)
    samples: list[Sample] = []
    done, success, too_long = False, False, False
    n_actions = n_valid = n_effective = 0
    total_reward = 0.0
    for turn in range(1, max_turns + 1):
        history.observe(obs, actions_left=(max_turns - turn + 1) * agent.max_actions_per_turn)
        prompt = builder.build(history)
        try:
            gen = await generate(prompt.ids, sampling)
        except PromptTooLong:  # truncated here, like a turn limit (no samples: dropped)
            too_long = True
            break
        parsed = parse_response(tokenizer.decode(gen.output_ids, skip_special_tokens=True), agent,
                                finished=gen.finish_reason == "stop")
        reward, all_valid = 0.0, True
        for action in parsed.actions:
            obs, r, done, info = await _env_call(spec, "step", env.step, action)
            reward += float(r)
            n_actions += 1
            all_valid &= bool(info.get("action_is_valid"))
            n_valid += bool(info.get("action_is_valid"))
            n_effective += bool(info.get("action_is_effective"))
            success = success or bool(info.get("success"))
            if done:
                break
        if not parsed.format_ok or not all_valid:  # RAGEN: a broken format or an unknown action
            reward += agent.format_penalty
        total_reward += reward
        history.record(gen.output_ids, parsed, reward)
        samples.append(Sample(
            prompt_ids=prompt.ids, response_ids=list(gen.output_ids),
            rollout_logprobs=list(gen.logprobs), reward=reward, episode_id=spec.episode_id,
            group_id=spec.group_id, turn=turn, done=done, last=False,
            env_tag=spec.env_tag or spec.env_name, seed=spec.seed,
            info={"format_ok": parsed.format_ok, "finish_reason": gen.finish_reason}))
        if done:
            break
    if not samples:
        return Episode([], {"prompt_too_long": 1.0})
    samples[-1].last = True
    metrics = {"success": float(success), "reward": total_reward, "num_turns": float(len(samples)),
               "num_actions": float(n_actions),
               "valid_action_rate": n_valid / n_actions if n_actions else 0.0,
               "effective_action_rate": n_effective / n_actions if n_actions else 0.0,
               "format_ok_rate": sum(s.info["format_ok"] for s in samples) / len(samples),
               "prompt_too_long": float(too_long)}
    return Episode(samples, metrics)


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


async def run_episodes(specs: Sequence[EpisodeSpec], **kwargs) -> list[Episode]:
    """All episodes concurrently (each advances on its own generation), in ``specs`` order."""
    return list(await asyncio.gather(*(run_episode(s, **kwargs) for s in specs)))
