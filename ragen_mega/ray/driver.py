"""``ragen-mega train CONFIG [key=value ...]``: the StarPO / StarPO-S training loop.

One step, as docs/design.md draws it::

    rollout (all episodes concurrently over the SGLang engines)
      -> StarPO-S filter -> old log-probs (actor) and values (critic) -> advantages
      -> critic update -> actor update -> weight sync into the engines -> log -> checkpoint

In the critic's warm-up (the first ``critic.warmup_steps`` steps) the actor is not trained (its
optimizer and LR schedule do not move; ``train/actor_frozen`` is 1, no ``actor/*`` scalars). The
sync still runs and pushes the unchanged weights under the step's version: colocated engines
drop their weights for the train phase and must get them back, and weight versions stay the
loop's steps. It costs one sync per warm-up step (under 1% of a CPU demo step).

With ``rollout.mode: turns`` the rollout is every env stream's next ``turns_per_step`` turns
(``rollout/streams.py``) and an episode cut by the step's end bootstraps from the critic's value
of its next state (:meth:`Run.cut_values`).

:func:`build_run` places the pieces (engines, actor, critic, env workers) into a :class:`Run`;
:func:`train` is the loop. Resuming (``trainer.resume=auto``, ``ray/checkpoints.py``) restarts
after the newest complete step, and a resumed step replays the uninterrupted run's. SIGUSR1 or
SIGTERM (slurm's warning before preemption or the time limit) stops the loop after the step under
way, saved (``ray/preemption.py``).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ragen_mega.agent.parse import STOP_STRINGS
from ragen_mega.config import RunConfig, load_run_config
from ragen_mega.config_tree import ConfigError, to_dict
from ragen_mega.models.prepare import resolve_model
from ragen_mega.ray import checkpoints, preemption
from ragen_mega.ray.placement import ResourcePlan
from ragen_mega.ray.sync_check import max_logprob_diff
from ragen_mega.rollout.batch import build_batch, compute_advantages, filter_groups
from ragen_mega.rollout.episode import (Episode, GenerateFn, mix_specs, run_episode,
                                        train_step_specs)
from ragen_mega.rollout.faults import (FaultCounters, check_skipped_updates, count_rollout_faults,
                                       count_window_faults, play_or_drop)
from ragen_mega.rollout.metrics import summarize, summarize_window, weight_staleness
from ragen_mega.rollout.packing import layouts_agree, pack_trajectories
from ragen_mega.rollout.manager import PlayedStep
from ragen_mega.rollout.sample import Sample
from ragen_mega.rollout.seeding import seeded_generate
from ragen_mega.rollout.streams import EnvStreams, Window

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup
    from transformers import PreTrainedTokenizerBase

    from ragen_mega.ray.engine_group import EngineGroup
    from ragen_mega.ray.env_workers import EnvWorkerGroup
    from ragen_mega.ray.trainer_group import TrainerGroup


@dataclasses.dataclass
class Run:
    """The placed pieces of a run; whatever is not None yet is stopped by :meth:`shutdown`."""
    cfg: RunConfig
    model_dir: str
    tokenizer: PreTrainedTokenizerBase
    resources: ResourcePlan
    placement_group: PlacementGroup
    engines: EngineGroup | None = None
    actor: TrainerGroup | None = None
    critic: TrainerGroup | None = None
    env_workers: EnvWorkerGroup | None = None   # None: the envs live in the driver
    streams: EnvStreams | None = None   # rollout.mode=turns: the env streams (open_streams)
    weight_version: int = 0   # what the engines serve (a restarted engine is brought to it)
    #: trainer.async_rollout: the next step's rollout, played while this step trained (and
    #: saved with the step's checkpoint, so a resumed run trains on exactly these samples)
    pending: PlayedStep | None = None

    def shutdown(self) -> None:
        """Stop what this run started: trainer actors first (the actor closes its weight-update
        group with the live engines), then engines, env workers, the placement group. Every
        piece is stopped even if stopping another one fails."""
        from ray.util.placement_group import remove_placement_group

        with contextlib.ExitStack() as stack:  # callbacks run last-in first-out
            stack.callback(remove_placement_group, self.placement_group)
            if self.env_workers is not None:
                stack.callback(self.env_workers.kill)
            if self.engines is not None:
                stack.callback(self.engines.shutdown)
            if self.critic is not None:
                stack.callback(self.critic.kill)
            if self.actor is not None:
                stack.callback(self.actor.kill)

    def fault_counters(self, step: int) -> FaultCounters:
        """A fresh step's fault counters, describing each fault in ``RUN_DIR/faults.jsonl``."""
        return FaultCounters(step, Path(self.cfg.trainer.run_dir) / "faults.jsonl")

    def rollout(self, step: int, *, evaluate: bool = False, faults: FaultCounters | None = None
                ) -> tuple[list[Episode], float]:
        """Play one step's episodes (training seeds, or the held-out seeds at eval temperature).
        Episodes whose env raised are left out, counted in ``faults`` (``rollout/faults.py``)."""
        env, r = self.cfg.env, self.cfg.rollout
        if evaluate:
            specs = mix_specs(env.val_parts(), group_size=env.val_group_size,
                              first_seed=env.val_seed)
            temperature = r.val_temperature
        else:
            specs = train_step_specs(env.train_parts(), group_size=env.group_size,
                                     seed=env.seed, step=step)
            temperature = r.temperature

        def attempt(spec):  # each call starts the episode afresh: a replay after an engine restart
            return lambda open_env: run_episode(
                spec, tokenizer=self.tokenizer, agent=self.cfg.agent,
                generate=self.episode_generate(step, spec.episode_id, evaluate),
                sampling=self.sampling(temperature), max_turns=env.max_turns,
                env_steps_in_thread=r.env_steps_in_thread, open_env=open_env)
        episodes = (play_or_drop(spec, self.engines.replaying(attempt(spec), self.open_env))
                    for spec in specs)

        async def play():  # all episodes at once, each with its own (seeding) generate function
            return list(await asyncio.gather(*episodes))

        start = time.perf_counter()
        played = self.engines.run(play())
        seconds = time.perf_counter() - start
        return count_rollout_faults(played, faults or self.fault_counters(step),
                                    r.max_env_failure_rate), seconds

    def sampling(self, temperature: float) -> dict:
        r = self.cfg.rollout
        return {"temperature": temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens,
                "stop": list(STOP_STRINGS), "no_stop_trim": True}

    @property
    def open_env(self):
        return None if self.env_workers is None else self.env_workers.open

    def open_streams(self, saved: dict | None) -> None:
        """``rollout.mode=turns``: the run's env streams, where the checkpoint left them."""
        env, r = self.cfg.env, self.cfg.rollout
        self.streams = EnvStreams(env.train_parts(), group_size=env.group_size, seed=env.seed,
                                  turns_per_step=r.turns_per_step, tokenizer=self.tokenizer,
                                  agent=self.cfg.agent, max_turns=env.max_turns,
                                  env_steps_in_thread=r.env_steps_in_thread,
                                  open_env=self.open_env)
        if saved is not None:
            self.streams.load_state_dict(saved)

    def stream_rollout(self, step: int, faults: FaultCounters) -> tuple[Window, float]:
        """Every stream's ``turns_per_step`` turns with the weights of step ``step - 1``; stream
        ``s``'s k-th request of the step is seeded with (trainer.seed, step, s, k). Faults are
        counted in ``faults``; a window an engine restart cut short is played again from its
        start (each stream's episodes then replay from their resets, as on resume)."""
        from ragen_mega.ray.engine_group import EngineRestarted

        def generate_for(stream: int) -> GenerateFn:
            if not self.cfg.rollout.seeded:
                return self.engines.generate
            return seeded_generate(self.engines.generate, self.cfg.trainer.seed, "stream", step,
                                   stream)

        async def play_window() -> Window:
            start_state = self.streams.state_dict()
            while True:
                try:
                    return await self.streams.play(
                        generate_for, self.sampling(self.cfg.rollout.temperature),
                        weight_version=step - 1)
                except EngineRestarted:
                    self.engines.count_retried(len(self.streams.streams))
                    await self.streams.restore(start_state)

        start = time.perf_counter()
        window = self.engines.run(play_window())
        count_window_faults(window, faults, self.cfg.rollout.max_env_failure_rate)
        return window, time.perf_counter() - start

    def cut_values(self, samples: list[Sample], next_prompts: dict[int, list[int]]
                   ) -> torch.Tensor:
        """[B]: at each cut sample the critic's value of the state after the cut (its next
        prompt, valued and never trained on), 0 elsewhere."""
        out = torch.zeros(len(samples))
        rows = [i for i, s in enumerate(samples) if s.cut]
        if not rows:
            return out
        prompts = [next_prompts[samples[i].episode_id] for i in rows]
        dp = self.cfg.trainer.data_parallel   # the critic shards rows over its DP replicas
        prompts += [prompts[0]] * (-len(prompts) % dp)
        # one token after the prompt: column len(prompt) holds V(prompt) (the trainer's layout)
        seq = max(map(len, prompts)) + 1
        ids = torch.full((len(prompts), seq), self.tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p)
            attention[i, :len(p) + 1] = 1
        values = self.critic.compute_values({"input_ids": ids, "attention_mask": attention})
        out[rows] = values[torch.arange(len(rows)),
                           torch.tensor([len(p) for p in prompts[:len(rows)]])].float()
        return out

    def episode_generate(self, step: int, episode_id: int, evaluate: bool) -> GenerateFn:
        """The engines' generate function for one episode (``rollout/seeding.py``)."""
        if not self.cfg.rollout.seeded:
            return self.engines.generate
        return seeded_generate(self.engines.generate, self.cfg.trainer.seed,
                               "eval" if evaluate else "train", step, episode_id)

    def play(self, step: int) -> PlayedStep:
        """Step ``step``'s rollout with the weights the engines serve now (episodes mode, or
        the streams' window), its samples stamped with that weight version."""
        faults = self.fault_counters(step)
        version = self.weight_version
        if self.streams is None:
            episodes, rollout_s = self.rollout(step, faults=faults)
            samples = [s for e in episodes for s in e.samples]
            for sample in samples:
                sample.weight_version = version
            return PlayedStep(samples, summarize(episodes, "rollout"), rollout_s, faults)
        window, rollout_s = self.stream_rollout(step, faults)
        return PlayedStep(window.samples, summarize_window(
            window.samples, window.finished, "rollout", trained_version=step - 1), rollout_s,
            faults, window)

    def train_step(self, step: int) -> dict[str, float]:
        """Play (or, ``trainer.async_rollout``, take the rollout played during the previous
        step's training), filter, train, sync. With ``async_rollout`` the next step's rollout
        plays on the engines while this step trains, and is waited for before the sync."""
        cfg = self.cfg
        t0 = time.perf_counter()
        current, self.pending = self.pending or self.play(step), None
        window, faults, rollout_s = current.window, current.faults, current.rollout_s
        played, metrics = current.samples, dict(current.metrics)
        next_rollout = None
        if cfg.trainer.async_rollout:
            metrics["rollout/weight_staleness"] = weight_staleness(played, step - 1)
            if step < cfg.trainer.total_steps:
                next_rollout = _in_background(self.play, step + 1)
        if cfg.trainer.colocate:  # the engines give the shared devices to the trainer phase
            self.engines.release_memory()
        samples, filter_metrics = filter_groups(played, cfg.filter.ratio, cfg.filter.mode,
                                                by_stream=window is not None)
        metrics.update(filter_metrics)
        batch = build_batch(samples, pad_id=self.tokenizer.pad_token_id)
        agg_modes = [cfg.actor.loss_agg_mode] + (
            [cfg.critic.loss_agg_mode] if cfg.critic.enable else [])
        layout = pack_trajectories(samples, batch, enabled=layouts_agree(
            cfg.trainer.pack_trajectories, agg_modes))
        train = layout.batch  # what actor and critic see; the estimators read the per-turn batch
        metrics.update(layout.metrics)
        t1 = time.perf_counter()
        if cfg.algo.use_rollout_logprobs:
            train["old_logprobs"] = train["rollout_logprobs"]
        else:
            train["old_logprobs"] = self.actor.compute_logprobs(train)
            mask = train["loss_mask"].bool()
            metrics["train/rollout_vs_trainer_logprob_diff"] = float(
                (train["old_logprobs"] - train["rollout_logprobs"])[mask].abs().mean())
        values = None
        if self.critic is not None:
            train["old_values"] = self.critic.compute_values(train)
            values = layout.to_per_turn(train["old_values"])
        batch = compute_advantages(batch, estimator=cfg.algo.adv_estimator, gamma=cfg.algo.gamma,
                                   lam=cfg.algo.lam, reward_norm=cfg.algo.reward_norm,
                                   grpo_norm_by_std=cfg.algo.grpo_norm_by_std,
                                   whiten=cfg.algo.whiten_advantages, token_values=values,
                                   bootstrap_values=None if window is None else
                                   self.cut_values(samples, window.next_prompts))
        for key in ("advantages", "returns"):
            if key in batch:
                train[key] = layout.to_train(batch[key])
        if self.critic is not None:
            metrics.update(self.critic.train(train))
        actor_frozen = step <= cfg.critic.warmup_steps  # critic warm-up: no actor/* this step
        if not actor_frozen:
            metrics.update(self.actor.train(train))
        metrics["train/actor_frozen"] = float(actor_frozen)
        for role in ("actor", "critic"):
            if metrics.get(f"{role}/updates_skipped"):
                faults.record("updates_skipped", int(metrics[f"{role}/updates_skipped"]),
                              role=role, reason="NaN or inf in the loss or the gradients")
        t2 = time.perf_counter()
        if next_rollout is not None:  # the engines must be idle before new weights go in
            self.pending = next_rollout.result()
            metrics["time/rollout_wait_s"] = time.perf_counter() - t2
        t_sync = time.perf_counter()
        metrics.update(self.sync_weights(step))
        t3 = time.perf_counter()
        if cfg.trainer.check_weight_sync:
            metrics["sync/max_logprob_diff"] = max_logprob_diff(self.engines, self.actor,
                                                                self.tokenizer)
        tokens = int(train["attention_mask"].sum())
        metrics.update({"time/rollout_s": rollout_s, "time/train_s": t2 - t1,
                        "time/sync_s": t3 - t_sync, "time/step_s": t3 - t0,
                        "time/train_tokens_per_s": tokens / max(t2 - t1, 1e-9),
                        "train/batch_samples": float(len(samples)),
                        "train/batch_tokens": float(tokens),
                        "weight_version": float(step), **faults.metrics()})
        metrics.update(self.engines.take_fault_counts())  # since the previous step's
        return metrics

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the actor's weights into every engine as ``version``. Colocated engines are
        released at this point (after start-up, and after each rollout): they take their weight
        memory back first and their KV cache only once the weights are in (slime's order)."""
        if self.cfg.trainer.colocate:
            self.engines.resume_memory(["weights"])
        metrics = self.actor.sync_weights(version)
        self.weight_version = version
        if self.cfg.trainer.colocate:
            self.engines.resume_memory(["kv_cache"])
        return metrics

    def resync_engine(self, engine: int, url: str) -> None:
        """Engine ``engine`` was restarted at ``url``: the actor's weight-update channel takes
        it in and the current weights go out again (``EngineGroup.resync``)."""
        self.actor.replace_engine(engine, url, self.weight_version)

    def evaluate(self) -> dict[str, float]:
        episodes, seconds = self.rollout(0, evaluate=True)
        return {**summarize(episodes, "val"), "time/eval_s": seconds}


def _in_background(fn, *args) -> Future:
    """``fn(*args)`` on a daemon thread; its result (or exception) in the returned future. A
    daemon: if the step fails while an overlapped rollout is in flight, the run's teardown
    stops the engines under it and the driver can exit without waiting for it."""
    future: Future = Future()

    def work():
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)
    threading.Thread(target=work, name="overlapped-rollout", daemon=True).start()
    return future


@contextlib.contextmanager
def build_run(cfg: RunConfig, *, with_trainers: bool = True) -> Iterator[Run]:
    """Start Ray (or join it), place engines, trainers and env workers, connect the weight sync;
    on leaving the block (also when building fails halfway) stop whatever was started.
    ``with_trainers=False``: engines and env workers only, serving ``model.path`` as it is."""
    from transformers import AutoTokenizer

    from ragen_mega.ray.cluster import init_ray
    from ragen_mega.ray.placement import create_placement_group, plan_resources

    model_dir = resolve_model(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    init_ray(cfg.trainer.ray_address)
    import ray

    resources = plan_resources(cfg, cluster_cpus=ray.cluster_resources().get("CPU", 1),
                               host_cpus=os.cpu_count() or 1, use_gpu=torch.cuda.is_available(),
                               with_trainers=with_trainers)
    run = Run(cfg, model_dir, tokenizer, resources, create_placement_group(resources.placement))
    try:
        _place(run, with_trainers)
        yield run
    except BaseException:
        try:  # the error that stopped the run is the one to report, not a teardown's
            run.shutdown()
        except Exception as e:  # noqa: BLE001 - reported, then the original is re-raised
            warnings.warn(f"stopping the run after an error also failed: {e!r}")
        raise
    run.shutdown()


def _place(run: Run, with_trainers: bool) -> None:
    """Start the run's processes one at a time, each kept in ``run`` as soon as it exists."""
    from ragen_mega.ray.engine_group import EngineGroup
    from ragen_mega.ray.env_workers import EnvWorkerGroup
    from ragen_mega.ray.trainer_group import TrainerGroup

    cfg, res, pg, t = run.cfg, run.resources, run.placement_group, run.cfg.trainer
    log_dir = Path(t.run_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    run.engines = EngineGroup(run.model_dir, pg, res.placement.engine_bundles,
                              tp=cfg.rollout.engine_tp, dtype=cfg.model.dtype,
                              log_dir=str(log_dir.resolve()), num_cpus=res.engine_cpus,
                              seeded_sampling=cfg.rollout.seeded, memory_saver=t.colocate,
                              mem_fraction=cfg.rollout.mem_fraction,
                              max_restarts_per_step=cfg.rollout.max_engine_restarts_per_step)
    if res.placement.env_worker_bundles:
        run.env_workers = EnvWorkerGroup(pg, res.placement.env_worker_bundles,
                                         num_cpus=res.env_worker_cpus)
    if not with_trainers:
        return
    if t.colocate:  # the trainer ranks about to be built need the shared devices
        run.engines.release_memory()
    place = dict(num_cpus=res.trainer_cpus, num_gpus=res.trainer_gpus,
                 threads=res.trainer_threads, seed=t.seed)
    run.actor = TrainerGroup("actor", run.model_dir, cfg.actor, pg, res.actor_bundles, **place,
                             total_steps=max(t.total_steps - cfg.critic.warmup_steps,
                                             cfg.actor.lr_warmup_steps + 1),
                             temperature=max(cfg.rollout.temperature, 1e-6))
    if cfg.critic.enable:
        run.critic = TrainerGroup("critic", run.model_dir, cfg.critic, pg, res.critic_bundles,
                                  **place,
                                  total_steps=max(t.total_steps, cfg.critic.lr_warmup_steps + 1))
    run.actor.connect_engines(run.engines.urls, run.engines.tp_sizes,
                              mode="tensor" if t.colocate else "distributed",
                              bucket_bytes=t.sync_bucket_mb << 20)
    run.engines.resync = run.resync_engine


def train(cfg: RunConfig) -> list[dict[str, float]]:
    """Run the loop; returns every step's metrics (also in TensorBoard and metrics.jsonl).
    Raises :class:`~ragen_mega.ray.preemption.Preempted` after a stop signal (SIGUSR1/SIGTERM),
    once the step under way is checkpointed and the run's processes are stopped."""
    from ragen_mega.logging import RunLogger
    from ragen_mega.ray.cluster import init_ray

    run_dir = Path(cfg.trainer.run_dir)
    init_ray(cfg.trainer.ray_address)  # first: ray.init puts its own handler on SIGTERM
    with preemption.stop_on_signals() as stop, build_run(cfg) as run:
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        logger = RunLogger(run_dir / "tensorboard", cfg.trainer.total_steps, cfg.echo_trap)
        try:
            return run_loop(cfg, run, logger, stop)
        finally:
            logger.close()


def run_loop(cfg: RunConfig, run: Run, logger, stop: preemption.StopRequest
             ) -> list[dict[str, float]]:
    """Resume, then step until ``trainer.total_steps`` or until ``stop`` is requested: the step
    under way is finished and saved, then :class:`~ragen_mega.ray.preemption.Preempted`."""
    t, run_dir = cfg.trainer, Path(cfg.trainer.run_dir)
    history = []
    start, saved_streams, run.pending = checkpoints.resume(cfg, run.actor, run.critic)
    if cfg.rollout.mode == "turns":
        run.open_streams(saved_streams)
    run.sync_weights(start)  # engines serve exactly the trainer's weights from now on
    if start == 0 and t.eval_every:  # step 0: the start weights, the base of every curve
        metrics = run.evaluate()
        logger.log(0, metrics)
        _append_metrics(run_dir, 0, metrics)
    for step in range(start + 1, t.total_steps + 1):
        if stop.requested:  # signalled before the first step: the resumed checkpoint is newest
            raise preemption.Preempted(stop.signal_name, start)
        metrics = run.train_step(step)
        if t.eval_every and step % t.eval_every == 0:
            metrics.update(run.evaluate())
        logger.log(step, metrics)
        history.append({"step": step, **metrics})
        _append_metrics(run_dir, step, metrics)
        check_skipped_updates(metrics, t.max_skipped_updates_in_row)  # before saving this step
        last = step == t.total_steps
        if last or stop.requested or (t.save_every and step % t.save_every == 0):
            checkpoints.save(cfg, step, run.actor, run.critic,
                             streams=run.streams.state_dict() if cfg.rollout.mode == "turns"
                             else None, pending=run.pending)
        if stop.requested and not last:
            raise preemption.Preempted(stop.signal_name, step)
    return history


def _append_metrics(run_dir: Path, step: int, metrics: dict[str, float]) -> None:
    """One line of ``RUN_DIR/metrics.jsonl`` (what ``ragen-mega plot`` reads)."""
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")


def main(argv: list[str] | None = None) -> int:
    """``ragen-mega train CONFIG.yaml [key=value ...]``"""
    import argparse

    parser = argparse.ArgumentParser(prog="ragen-mega train", description=main.__doc__)
    parser.add_argument("config", help="YAML config file (see examples/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.lr=1e-6")
    args = parser.parse_args(argv)
    try:
        cfg = load_run_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"ragen-mega train: config error: {e}", file=sys.stderr)
        return 2
    try:
        train(cfg)
    except preemption.Preempted as stopped:
        print(f"ragen-mega train: {stopped}", file=sys.stderr, flush=True)
        return preemption.PREEMPTED_EXIT_CODE
    return 0
