"""The rollout manager: how one step's rollout is played over the engines.

It owns everything between "the engines serve weights version k" and "here are the step's
samples": episode specs and seeds (``rollout/seeding.py``), episodes mode (every episode played
to its end, all at once) or the env streams' window (``rollout.mode: turns``,
``rollout/streams.py``), seeded sampling, replaying what a restarted engine cut short, the fault
counters, playing the next step in the background (``async_mode: one_step_off``) and the
held-out evaluation. ``train.py`` and ``ragen-mega eval`` both play through it; tests inject
faults here. It holds no trainer: weights reach the engines elsewhere (``ray/run.py``) and the
caller passes the weight version.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from ragen_mega.agent.parse import STOP_STRINGS
from ragen_mega.rollout.types import DroppedEpisode, EpisodeSpec, GenerateFn, OpenEnvFn
from ragen_mega.rollout.seeding import mix_specs, train_parts, train_step_specs, val_parts
from ragen_mega.rollout.episode import Episode, run_episode
from ragen_mega.rollout.faults import (FaultCounters, count_rollout_faults, count_window_faults,
                                       episode_or_drop, replay_on_restart)
from ragen_mega.http_token import GATEWAY_TOKEN, token_from_env
from ragen_mega.rollout.gateway import Gateway
from ragen_mega.rollout.metrics import summarize, summarize_window
from ragen_mega.rollout.sample import Sample
from ragen_mega.rollout.seeding import seeded_generate
from ragen_mega.rollout.streams import EnvStreams, Window
from ragen_mega.rollout.user_agent import load_agent, play_agent_episode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ragen_mega.config import RunConfig
    from ragen_mega.ray.engine_group import EngineGroup


@dataclasses.dataclass
class PlayedStep:
    """One step's rollout, ready to train on: its samples, ``rollout/*`` metrics, seconds, the
    step's fault counters, and (``rollout.mode=turns``) the window it came from."""
    samples: list[Sample]
    metrics: dict[str, float]
    rollout_s: float
    faults: FaultCounters
    window: Window | None = None

    def state_dict(self) -> dict:
        """Plain values only, so a checkpoint keeping a pending rollout (``async_mode:
        one_step_off``) loads with ``torch.load(weights_only=True)`` and survives a renamed
        class. Of a streamed window only the prompts after its cuts (the critic's bootstrap) are
        kept; its finished and dropped episodes are in the metrics and fault counters already."""
        state = {"samples": [s.to_dict() for s in self.samples],
                 "metrics": {str(k): float(v) for k, v in self.metrics.items()},
                 "rollout_s": float(self.rollout_s), "faults": self.faults.state_dict()}
        if self.window is not None:
            state["next_prompts"] = [[int(episode), [int(t) for t in prompt]]
                                     for episode, prompt in self.window.next_prompts.items()]
        return state

    @classmethod
    def from_state_dict(cls, state: dict, log_path=None) -> PlayedStep:
        """The step :meth:`state_dict` saved; its fault counters describe further faults (the
        step's skipped updates) in ``log_path`` (``RUN_DIR/faults.jsonl``)."""
        samples = [Sample.from_dict(s) for s in state["samples"]]
        window = None
        if "next_prompts" in state:
            window = Window(samples, [], {int(e): list(p) for e, p in state["next_prompts"]})
        return cls(samples, dict(state["metrics"]), float(state["rollout_s"]),
                   FaultCounters.from_state_dict(state["faults"], log_path), window)


class RolloutManager:
    """Plays a run's rollouts: ``engines`` (an :class:`~ragen_mega.ray.engine_group.EngineGroup`:
    ``generate``, ``run``, and its ``supervisor``, which restarts dead engines and counts the
    episodes played again) serve the policy; ``open_env`` opens each episode's env in an env
    worker (None: in this process)."""

    def __init__(self, cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, engines: EngineGroup,
                 open_env: OpenEnvFn | None = None):
        self.cfg, self.tokenizer, self.engines, self.open_env = cfg, tokenizer, engines, open_env
        self.streams: EnvStreams | None = None   # rollout.mode=turns, after load_state_dict
        r = cfg.rollout
        #: rollout.agent: the user's agent, and the gateway its episodes call the engines through
        self.agent = None if r.agent is None else load_agent(r.agent)
        self.gateway = None if r.agent is None else Gateway(
            tokenizer, r.gateway_host, r.gateway_port, token=token_from_env(GATEWAY_TOKEN))

    def fault_counters(self, step: int) -> FaultCounters:
        """A fresh step's fault counters, describing each fault in ``RUN_DIR/faults.jsonl``."""
        return FaultCounters(step, Path(self.cfg.trainer.run_dir) / "faults.jsonl")

    def load_state_dict(self, saved: dict | None) -> None:
        """Where a checkpoint left the rollout (None: a fresh start). ``rollout.mode=turns``
        opens the run's env streams there; episodes mode keeps nothing between steps."""
        if self.cfg.rollout.mode != "turns":
            return
        env, r = self.cfg.env, self.cfg.rollout
        self.streams = EnvStreams(train_parts(env), group_size=env.group_size, seed=env.seed,
                                  turns_per_step=r.turns_per_step, tokenizer=self.tokenizer,
                                  agent=self.cfg.agent, max_turns=env.max_turns,
                                  env_steps_in_thread=r.env_steps_in_thread,
                                  open_env=self.open_env)
        if saved is not None:
            self.streams.load_state_dict(saved)

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of the rollout: the env streams' state (turns mode), or None
        (episodes mode)."""
        return None if self.streams is None else self.streams.state_dict()

    def rollout(self, step: int, weight_version: int) -> PlayedStep:
        """Step ``step``'s rollout (episodes mode, or the streams' window) with the weights the
        engines serve now, ``weight_version``; its samples are stamped with that version."""
        faults = self.fault_counters(step)
        if self.streams is None:
            episodes, rollout_s = self.episodes(step, faults=faults)
            samples = [s for e in episodes for s in e.samples]
            for sample in samples:
                sample.weight_version = weight_version
            return PlayedStep(samples, summarize(episodes, "rollout"), rollout_s, faults)
        window, rollout_s = self.window(step, faults, weight_version)
        return PlayedStep(window.samples, summarize_window(
            window.samples, window.finished, "rollout", trained_version=step - 1), rollout_s,
            faults, window)

    def rollout_in_background(self, step: int, weight_version: int) -> Future:
        """:meth:`rollout` on a daemon thread (``async_mode: one_step_off``); its PlayedStep (or
        exception) in the returned future. The thread only drives the engines' HTTP clients and
        the envs on its own event loop; trainer calls stay on the caller's thread, so an engine
        restarted under it ends it (``EngineRestarted``, not ``resynced``) and gets its weights
        at the next sync. A daemon, so a failed step's teardown need not wait for it."""
        future: Future = Future()

        def work():
            try:
                with self.engines.supervisor.deferred():  # no trainer call from this thread
                    future.set_result(self.rollout(step, weight_version))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(e)
        threading.Thread(target=work, name="overlapped-rollout", daemon=True).start()
        return future

    def episodes(self, step: int, *, evaluate: bool = False, faults: FaultCounters | None = None,
                 show_progress: bool = False) -> tuple[list[Episode], float]:
        """Play one step's episodes (training seeds, or held-out seeds at eval temperature) all
        at once; also return the seconds taken. An episode a restarted engine cut short is
        replayed; one whose env raised is left out and counted in ``faults``. ``show_progress``:
        a progress bar of finished episodes (``ragen-mega eval``)."""
        env = self.cfg.env
        specs = (mix_specs(val_parts(env), group_size=env.val_group_size,
                           first_seed=env.val_seed) if evaluate else self.train_specs(step))
        played = (self.play_episode(spec, step, evaluate=evaluate) for spec in specs)

        async def play_all():
            async with (self.gateway.serving() if self.gateway else contextlib.nullcontext()):
                if show_progress:   # tqdm's gather keeps the episodes in their order
                    from tqdm.asyncio import tqdm

                    return list(await tqdm.gather(*played, total=len(specs), unit="episode",
                                                  desc="held-out episodes"))
                return list(await asyncio.gather(*played))

        start = time.perf_counter()
        outcome = self.engines.run(play_all())
        seconds = time.perf_counter() - start
        return count_rollout_faults(outcome, faults or self.fault_counters(step),
                                    self.cfg.rollout.max_env_failure_rate), seconds

    def train_specs(self, step: int) -> list[EpisodeSpec]:
        """Training step ``step``'s episodes (their seeds a function of the step)."""
        env = self.cfg.env
        return train_step_specs(train_parts(env), group_size=env.group_size, seed=env.seed,
                                step=step)

    async def play_episode(self, spec: EpisodeSpec, step: int, *, evaluate: bool = False,
                           wait_for_sync: bool = False) -> Episode | DroppedEpisode:
        """One episode of step ``step`` (training or held-out temperature), replayed whenever a
        restarted engine cut it short (``wait_for_sync``: also when that engine waits for the
        next sync; :func:`replay_on_restart`); one whose env raised comes back as a
        :class:`DroppedEpisode`."""
        env, r = self.cfg.env, self.cfg.rollout
        temperature = r.val_temperature if evaluate else r.temperature

        def play():  # each call starts the episode afresh, its env opened anew: a replay
            generate = self._generate("eval" if evaluate else "train", step, spec.episode_id)
            if self.agent is not None:
                return play_agent_episode(
                    spec, agent=self.agent, gateway=self.gateway, generate=generate,
                    sampling={"temperature": temperature, "top_p": r.top_p,
                              "max_new_tokens": r.max_new_tokens},
                    max_turns=env.max_turns, env_steps_in_thread=r.env_steps_in_thread,
                    open_env=self.open_env)
            return run_episode(
                spec, tokenizer=self.tokenizer, agent=self.cfg.agent, generate=generate,
                sampling=self._sampling(temperature), max_turns=env.max_turns,
                env_steps_in_thread=r.env_steps_in_thread, open_env=self.open_env)
        return await episode_or_drop(spec, replay_on_restart(
            play, retried=lambda: self.engines.supervisor.count_retried(1),
            wait_for_sync=wait_for_sync))

    def window(self, step: int, faults: FaultCounters, weight_version: int
               ) -> tuple[Window, float]:
        """Every stream's ``turns_per_step`` turns with the weights the engines serve,
        ``weight_version`` (step ``step - 1``'s, or ``step - 2``'s when the window plays while
        step ``step - 1`` trains); stream ``s``'s k-th request is seeded with (trainer.seed,
        step, s, k). Faults are counted in ``faults``. A window an engine restart cut short is
        replayed from its start (each stream's episodes from their resets, as on resume). A
        window that ends in an error leaves the streams where it started, so an overlapped one
        that met an engine waiting for weights can replay after the step's sync."""
        sampling = self._sampling(self.cfg.rollout.temperature)

        async def play_window() -> Window:
            start_state = self.streams.state_dict()
            try:
                return await replay_on_restart(
                    lambda: self.streams.play_window(
                        lambda stream: self._generate("stream", step, stream), sampling,
                        weight_version=weight_version),
                    retried=lambda: self.engines.supervisor.count_retried(
                        len(self.streams.streams)),
                    undo=lambda: self.streams.restore(start_state))
            except Exception:
                await self.streams.restore(start_state)
                raise

        start = time.perf_counter()
        window = self.engines.run(play_window())
        count_window_faults(window, faults, self.cfg.rollout.max_env_failure_rate)
        return window, time.perf_counter() - start

    async def play_stream_window(self, stream, step: int) -> Window:
        """One env stream's part of step ``step``'s window (``EnvStreams.play_stream``), seeded
        as in :meth:`window` by a generate function made afresh for each call (a replay samples
        what the cut try sampled)."""
        return await self.streams.play_stream(
            stream, self._generate("stream", step, stream.index),
            self._sampling(self.cfg.rollout.temperature))

    def evaluate(self) -> tuple[dict[str, float], list[Sample]]:
        """The held-out evaluation: ``val/*`` metrics and ``time/eval_s``, and its samples."""
        episodes, seconds = self.episodes(0, evaluate=True)
        return ({**summarize(episodes, "val"), "time/eval_s": seconds},
                [s for e in episodes for s in e.samples])

    def _sampling(self, temperature: float) -> dict:
        r = self.cfg.rollout
        return {"temperature": temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens,
                "stop": list(STOP_STRINGS), "no_stop_trim": True}

    def _generate(self, kind: str, step: int, key: int) -> GenerateFn:
        """The engines' generate function for one episode or stream (``kind``: train, eval or
        stream); with ``rollout.seeded`` each request is seeded by (trainer.seed, kind, step,
        key, its index), so a replay or a resumed step samples the same tokens."""
        if not self.cfg.rollout.seeded:
            return self.engines.generate
        return seeded_generate(self.engines.generate, self.cfg.trainer.seed, kind, step, key)
