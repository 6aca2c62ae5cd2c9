"""The ``rollout`` section of the run config: sampling, engines, env placement, fault allowances
and the user's agent (the run's tree is ``ragen_mega/config.py``)."""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from ragen_mega.config_tree import ConfigError, bounded, setting


@dataclasses.dataclass
class RolloutConfig:
    temperature: float = bounded(1.0, ge=0, help="sampling temperature of training rollouts")
    top_p: float = bounded(1.0, gt=0, le=1, help="nucleus sampling of rollouts (1: off)")
    max_new_tokens: int = bounded(400, ge=1, help=(
        "tokens a response may have in one turn (RAGEN: response_length)"))
    val_temperature: float = bounded(0.0, ge=0, help=(
        "sampling temperature of held-out evaluation (0: greedy)"))
    num_engines: int = setting(1, help="SGLang engines (servers) the rollouts share")
    engine_tp: int = setting(1, help="tensor-parallel ranks (devices) of each engine")
    engine_ep: int = setting(1, help=(
        "a mixture of experts: SGLang's --ep-size, the engine's ranks splitting the experts (a "
        "divisor of engine_tp and of the expert count); 1: each expert split over the TP ranks"))
    env_steps_in_thread: bool = setting(False, help=(
        "step the envs in a thread of the driver, beside the engines' requests: for slow envs "
        "(Crafter); with env_workers: 0 only"))
    env_workers: int = bounded(0, ge=0, note="0: envs in the driver", help=(
        "Ray actors that host the envs (episode i on worker i % env_workers), each in its own "
        "placement-group bundle, so long-horizon runs step 100+ envs on the cluster's CPUs "
        "instead of in the driver; 0: every env lives in the driver (env_steps_in_thread applies "
        "only then)"))
    seeded: bool = setting(True, help=(
        "every request carries a sampling seed derived from (trainer.seed, step, episode, turn), "
        "and the engines sample it as a pure function of seed and logits (SGLang's seeded "
        "Gumbel-max sampler; on GPU that means --enable-deterministic-inference). A step's "
        "rollout is then a function of the step and the weights, so a resumed run replays the "
        "uninterrupted one. false: SGLang's unseeded sampler."))
    batch_requests: bool = setting(False, help=(
        "the requests made together (a turn of every live episode) go to each engine as one "
        "batched /generate, each with its own sampling seed, so the same tokens, with less "
        "HTTP work per request (a small model on CPU: 12% off the rollout, "
        "benchmarks/README.md); each turn then waits for its batch's slowest response "
        "(RAGEN's turn-by-turn batches). false: every request on its own (for long, uneven "
        "responses)"))
    mem_fraction: Optional[float] = bounded(
        None, gt=0, lt=1, note="or null: SGLang's default", help=(
            "GPU: SGLang's --mem-fraction-static, the share of each GPU an engine takes for "
            "weights and KV cache (null: SGLang's default, ~0.9). Colocated runs keep the "
            "trainer's weights and optimizer on the same GPUs during rollout, so give the engines "
            "less (e.g. 0.4)."))
    mode: Literal["episodes", "turns"] = setting("episodes", help=(
        "episodes: each step plays every episode to its end (RAGEN). turns: env streams that live "
        "across steps, each playing exactly `turns_per_step` turns a step; an episode cut by the "
        "step's end goes on in the next one and its advantage bootstraps from the critic "
        "(Verlog's fixed-turn batches for long horizons; `rollout/streams.py`). Needs an "
        "estimator that scores cut episodes (algo.adv_estimator: gae or gigpo)."))
    turns_per_step: Optional[int] = bounded(None, ge=1, help=(
        "turns mode: turns every stream (env.env_groups x env.group_size of them) plays per step"))
    max_engine_restarts_per_step: int = bounded(
        2, ge=0, note="0: a dead engine ends the run", help=(
            "an engine whose server dies during a step is restarted on its devices, given the "
            "current weights, and its episodes are replayed from their start (same seeds, same "
            "episodes); this many restarts per step, then the run stops with an error naming the "
            "engine's log"))
    max_env_failure_rate: float = bounded(0.1, ge=0, le=1, help=(
        "an episode whose env raises (at make, reset, step or close) is dropped and the step goes "
        "on with the others; more than this fraction of a step's episodes dropped so ends the "
        "run, naming the env, seed and exception (a broken env, not bad luck)"))
    agent: Optional[str] = setting(None, help=(
        "an agent of yours plays every episode instead of the built-in prompts and parser (the "
        "agent section): MODULE:FUNCTION or FILE.py:FUNCTION, an async function given an "
        "AgentTask (rollout/user_agent.py) that calls the engines through the run's "
        "OpenAI-compatible gateway (rollout/gateway.py); null: the built-in agent"))
    gateway_host: str = setting("127.0.0.1", help=(
        "where the gateway listens while a rollout plays (port 0: a free port, the same for the "
        "rest of the run); the agents get their episode's URL, so only the agents' host matters"))
    gateway_port: int = bounded(0, ge=0, le=65535, note="a TCP port; 0: any free one", help=(
        "the agent gateway's port (rollout.agent)"))

    def validate(self):
        if self.engine_ep < 1 or self.engine_tp % self.engine_ep:
            raise ConfigError(f"engine_ep: SGLang's expert parallelism splits an engine's TP "
                              f"ranks, so it must divide engine_tp={self.engine_tp}, got "
                              f"{self.engine_ep}")
        if self.agent is not None:
            where, _, name = self.agent.rpartition(":")
            if not where or not name:
                raise ConfigError(f"agent: MODULE:FUNCTION or FILE.py:FUNCTION, got "
                                  f"{self.agent!r}")
        if self.mode == "turns" and self.turns_per_step is None:
            raise ConfigError("turns_per_step: must be an integer >= 1 with rollout.mode=turns "
                              "(the turns each env stream plays per step), got None")
