"""Multi-turn episodes against the engines, all of them concurrently.

Every episode is its own coroutine (prompt, generation, env step, repeat), so it never waits for
the slowest one of the batch, as a lock-step "generate all, then step all" loop would. It drives
its env through an async :class:`EnvHandle`, so the same code plays an env in this process
(:class:`LocalEnv`; slow steps such as Crafter's in a worker thread, so the event loop keeps
feeding the engines) or in a Ray actor (``ray.env_workers``). Shared types are in
``rollout/types.py``; a step's seeds come from ``rollout/seeding.py``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

from ragen_mega.agent import AgentConfig, History, PromptBuilder, parse_response
from ragen_mega.envs import make
from ragen_mega.rollout.sample import Sample, jsonable
from ragen_mega.rollout.types import (EnvFailed, EnvHandle, EpisodeSpec, GenerateFn, OpenEnvFn,
                                      PromptTooLong)


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

    :func:`take_turn` advances it by one turn. :func:`run_episode` plays it to its end in one
    go and ``rollout/streams.py`` carries it over training steps; both play the same turns."""
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
    n_over_budget: int = 0      # turns whose answer named more actions than are played
    too_long: bool = False      # ended because the next prompt outgrew the engine's context
    #: the best ``info["progression"]`` of its steps (BALROG's metric), None if the env
    #: reports none
    progression: float | None = None

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
                "over_budget_rate": self.n_over_budget / self.turn if self.turn else 0.0,
                "prompt_too_long": float(self.too_long),
                **({} if self.progression is None else {"progression": self.progression})}


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
    observation, steps = state.obs, []
    reward, all_valid = 0.0, True
    for action in parsed.actions:
        state.obs, r, state.done, info = await env_call(spec, "step", state.env.step, action)
        steps.append({"action": action, "reward": float(r), "done": bool(state.done),
                      "info": jsonable(info)})
        reward += float(r)
        state.n_actions += 1
        all_valid &= bool(info.get("action_is_valid"))
        state.n_valid += bool(info.get("action_is_valid"))
        state.n_effective += bool(info.get("action_is_effective"))
        state.success = state.success or bool(info.get("success"))
        if "progression" in info:
            state.progression = max(state.progression or 0.0, float(info["progression"]))
        if state.done:
            break
    if not parsed.format_ok or not all_valid:  # RAGEN: a broken format or an unknown action
        reward += agent.format_penalty
    state.turn += 1
    state.reward += reward
    state.n_format_ok += parsed.format_ok
    state.n_over_budget += parsed.n_dropped > 0
    copied = state.builder.copies_example(parsed.actions)
    state.n_copied += copied
    state.history.record(gen.output_ids, parsed, reward)
    return Sample(
        prompt_ids=prompt.ids, response_ids=list(gen.output_ids),
        rollout_logprobs=list(gen.logprobs), reward=reward, episode_id=spec.episode_id,
        group_id=spec.group_id, turn=state.turn, done=state.done, last=state.over,
        env_tag=spec.env_tag or spec.env_name, seed=spec.seed,
        info={"format_ok": parsed.format_ok, "finish_reason": gen.finish_reason, "steps": steps,
              "example_copy": copied},
        state_key=state_key, observation=observation, routed_experts=gen.routed_experts,
        token_versions=list(gen.versions or []))


async def run_episode(spec: EpisodeSpec, *, tokenizer, agent: AgentConfig, generate: GenerateFn,
                      sampling: dict[str, Any], max_turns: int,
                      env_steps_in_thread: bool = False,
                      open_env: OpenEnvFn | None = None) -> Episode:
    """Play one episode to its end or its turn limit (``spec.max_turns``, else ``max_turns``); one
    :class:`Sample` per turn. The env comes as in :func:`open_episode`. An env that raises raises
    :class:`EnvFailed`; a prompt the engine refuses as too long (:class:`PromptTooLong`) ends
    the episode before that turn (at turn 1: no samples, and the step drops the episode)."""
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
