"""Episodes played by an agent the user wrote (``rollout.agent: my_pkg.my_agent:run``).

The agent is an async function given an :class:`AgentTask`: its episode's base URL on the run's
OpenAI-compatible gateway (``rollout/gateway.py``), the episode's env (the same handle the
built-in episodes play), its seed, the turn limit and the sampling settings. It plays however it
likes (own prompts, parsing, memory, tools) and returns the reward: one number (paid on its last
turn) or one per gateway call (each call is one turn). Each call becomes a
:class:`~ragen_mega.rollout.sample.Sample` with the ids the engine saw and sampled, so the rest
of the stack treats the episode as a built-in one.

What the env saw (actions, valid and effective ones, success, the end) is recorded, so the
``rollout/*`` metrics mean the same for an agent's episodes. An env that raises drops the
episode (counted), even if the agent caught the error; so does an agent that raises (its
exception named in ``faults.jsonl``); an engine that died under a call restarts and the episode
is replayed from its start.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Awaitable, Callable, Sequence

from ragen_mega.rollout.types import EnvFailed, EnvHandle, EpisodeSpec, GenerateFn
from ragen_mega.rollout.episode import env_call, Episode, open_env_handle
from ragen_mega.rollout.gateway import Gateway
from ragen_mega.rollout.sample import Sample
from ragen_mega.user_code import load_object


@dataclasses.dataclass
class AgentTask:
    """What an agent is given for one episode."""
    base_url: str                 # the OpenAI base URL of this episode (``.../episodes/ID/v1``)
    env: EnvHandle                # ``await env.reset(seed)``, ``await env.step(action)``, ...
    seed: int
    max_turns: int                # calls the gateway answers in this episode
    sampling: dict[str, Any]      # temperature, top_p, max_tokens: the rollout's settings
    episode_id: int
    group_id: int
    api_key: str = "none"         # the gateway's token, for the agent's OpenAI client


AgentFn = Callable[[AgentTask], Awaitable["float | Sequence[float]"]]


def load_agent(path: str) -> AgentFn:
    """The async function ``path`` names: ``package.module:function`` (importable) or
    ``path/to/file.py:function``; ValueError naming what is wrong."""
    where, _, name = path.rpartition(":")
    fn = load_object(path)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{path!r}: {where} has no async function {name!r} (an agent is "
                         f"'async def {name}(task)')")
    return fn


class RecordingEnv:
    """The agent's env handle: the episode's env, with what it saw counted for the metrics and
    its first failure kept (an agent that swallows an env's error still loses the episode)."""

    def __init__(self, env: EnvHandle, spec: EpisodeSpec):
        self.env, self.spec = env, spec
        self.instruction, self.valid_actions = env.instruction, env.valid_actions
        self.failure: EnvFailed | None = None
        self.actions = self.valid = self.effective = 0
        self.success = self.done = False

    async def reset(self, seed: int) -> str:
        return await self._call("reset", self.env.reset, seed)

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        obs, reward, done, info = await self._call("step", self.env.step, action)
        self.actions += 1
        self.valid += bool(info.get("action_is_valid"))
        self.effective += bool(info.get("action_is_effective"))
        self.success = self.success or bool(info.get("success"))
        self.done = self.done or bool(done)
        return obs, reward, done, info

    async def state_key(self, observation: str) -> str:
        return await self._call("state_key", self.env.state_key, observation)

    async def _call(self, call: str, fn, *args):
        try:
            return await env_call(self.spec, call, fn, *args)
        except EnvFailed as e:
            self.failure = self.failure or e
            raise


async def play_agent_episode(spec: EpisodeSpec, *, agent: AgentFn, gateway: Gateway,
                             generate: GenerateFn, sampling: dict[str, Any], max_turns: int,
                             env_steps_in_thread: bool = False, open_env=None) -> Episode:
    """One episode of ``agent`` through ``gateway`` (which must be serving); ``sampling`` holds
    the rollout's ``temperature``, ``top_p`` and ``max_new_tokens``. Raises
    the engines' :class:`EngineRestarted` (replay it), or :class:`EnvFailed` (drop it)."""
    env = await open_env_handle(spec, open_env, env_steps_in_thread)
    recorded = RecordingEnv(env, spec)
    limit = spec.max_turns or max_turns
    calls = gateway.open_episode(spec.episode_id, generate, sampling, limit)
    task = AgentTask(gateway.url(spec.episode_id), recorded, spec.seed, limit,
                     {"temperature": sampling["temperature"], "top_p": sampling["top_p"],
                      "max_tokens": sampling["max_new_tokens"]}, spec.episode_id, spec.group_id,
                     gateway.token or "none")
    try:
        try:
            result = await agent(task)
        except Exception as e:  # noqa: BLE001 - the user's agent may raise anything
            if calls.engine_restarted:   # played again (as the engines' error says when)
                raise calls.engine_restarted from e
            raise recorded.failure or EnvFailed(spec, "agent", e) from e
    finally:
        gateway.close_episode(spec.episode_id)
        await env_call(spec, "close", env.close)
    if calls.engine_restarted:
        raise calls.engine_restarted
    if recorded.failure is not None:
        raise recorded.failure
    if not calls.calls:
        return Episode([], {"prompt_too_long": float(calls.prompt_too_long)})
    rewards = turn_rewards(spec, result, len(calls.calls))
    n = len(calls.calls)
    samples = [Sample(prompt_ids=c.prompt_ids, response_ids=list(c.generation.output_ids),
                      rollout_logprobs=list(c.generation.logprobs), reward=r,
                      episode_id=spec.episode_id, group_id=spec.group_id, turn=i + 1,
                      done=recorded.done and i == n - 1, last=i == n - 1,
                      env_tag=spec.env_tag or spec.env_name, seed=spec.seed,
                      token_versions=list(c.generation.versions or []),
                      info={"finish_reason": c.generation.finish_reason,
                            "extends": c.extends})
               for i, (c, r) in enumerate(zip(calls.calls, rewards))]
    a = recorded.actions
    return Episode(samples, {
        "success": float(recorded.success), "reward": float(sum(rewards)),
        "num_turns": float(n), "num_actions": float(a),
        "valid_action_rate": recorded.valid / a if a else 0.0,
        "effective_action_rate": recorded.effective / a if a else 0.0,
        "rerendered_calls": float(calls.rerendered),
        "prompt_too_long": float(calls.prompt_too_long)})


def turn_rewards(spec: EpisodeSpec, result: Any, calls: int) -> list[float]:
    """Per-call rewards from an agent's return value: a number is paid on the last call, a
    sequence must hold one number per call. Anything else fails the episode, naming it."""
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        return [0.0] * (calls - 1) + [float(result)]
    if (isinstance(result, Sequence) and not isinstance(result, str)
            and all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in result)):
        if len(result) != calls:
            raise EnvFailed(spec, "agent", ValueError(
                f"the agent returned {len(result)} rewards for its {calls} gateway calls"))
        return [float(r) for r in result]
    raise EnvFailed(spec, "agent", TypeError(
        f"the agent returned {result!r}: a reward (number) or one reward per gateway call"))
