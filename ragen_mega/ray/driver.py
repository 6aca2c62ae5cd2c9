"""``ragen-mega train CONFIG [key=value ...]``: the StarPO / StarPO-S training loop.

One step, as DESIGN.md draws it::

    rollout (all episodes concurrently over the SGLang engines)
      -> StarPO-S filter -> old log-probs (actor) and values (critic) -> advantages
      -> critic update -> actor update -> weight sync into the engines -> log -> checkpoint

:class:`Run` holds the placed pieces (engines, actor, critic, logger); :func:`train` is the loop.
Resuming (``trainer.resume=auto``) restarts from the newest step whose actor (and critic)
checkpoints are complete; env seeds and (``rollout.seeded``) sampling seeds are functions of the
step, so the data cursor is the step, and a resumed step replays the uninterrupted run's
(tests/test_resume_equivalence.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import json
import math
import os
import random
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from ragen_mega.algo.advantages import group_stats
from ragen_mega.config import RunConfig, load_run_config
from ragen_mega.config_tree import to_dict
from ragen_mega.rollout.batch import build_batch, compute_advantages, filter_groups
from ragen_mega.rollout.episode import (Episode, GenerateFn, mix_specs, run_episode,
                                        train_step_specs)

LATEST = "latest_step"


def resolve_model(path: str) -> str:
    """``smollm2`` -> the prepared SmolLM2 directory; otherwise an HF directory that must exist."""
    if path == "smollm2":
        from ragen_mega.models.prepare import prepare_smollm2

        return str(prepare_smollm2())
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"model.path: {path!r} is not a Hugging Face model directory "
                                f"(no config.json)")
    return path


def rng_states() -> dict:
    """The driver's Python, NumPy and torch RNG states. The loop itself draws from none of them
    (env and sampling seeds are functions of the step, the filter breaks no ties at random, the
    trainer has no dropout), but a user's env or hook may, so they are checkpointed too."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


def request_seed(*key) -> int:
    """A 63-bit sampling seed that is a pure function of ``key`` (stable across processes and
    Python versions, unlike ``hash``), spread so that neighbouring keys give unrelated seeds."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def summarize(episodes: list[Episode], prefix: str) -> dict[str, float]:
    """Means of the per-episode metrics, reward mean/std, response length and pass@k over groups
    of k episodes: over all episodes under ``prefix/`` and for each env tag under
    ``prefix/<tag>/`` (RAGEN logs per tag; a mixed run's total hides which env learns). Per tag
    also the mean in-group reward std, the echo-trap signal of that env (the run-wide one is the
    StarPO-S filter's own ``group_reward_std_before_filter``)."""
    out = _episode_stats(episodes, prefix)
    by_tag: dict[str, list[Episode]] = {}
    for e in episodes:
        by_tag.setdefault(e.samples[0].env_tag, []).append(e)
    for tag, tagged in by_tag.items():
        out.update(_episode_stats(tagged, f"{prefix}/{tag}"))
        group_ids = torch.tensor([e.samples[0].group_id for e in tagged])
        if len(tagged) > len(set(group_ids.tolist())):  # groups of more than one episode
            rewards = torch.tensor([e.metrics["reward"] for e in tagged])
            out[f"{prefix}/{tag}/group_reward_std_before_filter"] = float(
                group_stats(rewards, group_ids).std.mean())
    return out


def _episode_stats(episodes: list[Episode], prefix: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in episodes[0].metrics:
        out[f"{prefix}/{key}"] = sum(e.metrics[key] for e in episodes) / len(episodes)
    rewards = torch.tensor([e.metrics["reward"] for e in episodes])
    out[f"{prefix}/reward_mean"] = float(rewards.mean())
    out[f"{prefix}/reward_std"] = float(rewards.std()) if len(episodes) > 1 else 0.0
    lengths = [len(s.response_ids) for e in episodes for s in e.samples]
    out[f"{prefix}/response_length"] = sum(lengths) / len(lengths)
    groups: dict[int, list[float]] = {}
    for e in episodes:
        groups.setdefault(e.samples[0].group_id, []).append(e.metrics["success"])
    k = min(len(g) for g in groups.values())
    if k > 1:  # pass@k: a group counts if any of its k episodes succeeded
        out[f"{prefix}/pass@{k}"] = sum(max(g) for g in groups.values()) / len(groups)
    return out


@dataclasses.dataclass
class Run:
    cfg: RunConfig
    model_dir: str
    tokenizer: object
    engines: object
    actor: object
    critic: object | None
    placement_group: object
    env_workers: object | None = None   # EnvWorkerGroup; None: the envs live in the driver

    def shutdown(self) -> None:
        """Stop what this run started: engines, trainer actors, env workers, the placement group."""
        from ray.util.placement_group import remove_placement_group

        self.actor.kill()  # first: it closes its weight-update group with the live engines
        if self.critic is not None:
            self.critic.kill()
        self.engines.shutdown()
        if self.env_workers is not None:
            self.env_workers.kill()
        remove_placement_group(self.placement_group)

    def rollout(self, step: int, *, evaluate: bool = False) -> tuple[list[Episode], float]:
        """Play one step's episodes (training seeds, or the held-out seeds at eval temperature)."""
        env, r = self.cfg.env, self.cfg.rollout
        if evaluate:
            specs = mix_specs(env.val_parts(), group_size=env.val_group_size,
                              first_seed=env.val_seed)
            temperature = r.val_temperature
        else:
            specs = train_step_specs(env.train_parts(), group_size=env.group_size,
                                     seed=env.seed, step=step)
            temperature = r.temperature
        sampling = {"temperature": temperature, "top_p": r.top_p,
                    "max_new_tokens": r.max_new_tokens, "stop": ["</answer>"],
                    "no_stop_trim": True}

        async def play():
            try:  # all episodes at once, each with its own (seeding) generate function
                return list(await asyncio.gather(*(run_episode(
                    spec, tokenizer=self.tokenizer, agent=self.cfg.agent,
                    generate=self.episode_generate(step, spec.episode_id, evaluate),
                    sampling=sampling, max_turns=env.max_turns,
                    env_steps_in_thread=r.env_steps_in_thread,
                    open_env=None if self.env_workers is None else self.env_workers.open)
                    for spec in specs)))
            finally:
                await self.engines.close_clients()  # the clients belong to this event loop

        start = time.perf_counter()
        episodes = asyncio.run(play())
        return episodes, time.perf_counter() - start

    def episode_generate(self, step: int, episode_id: int, evaluate: bool) -> GenerateFn:
        """The engines' generate function for one episode. With ``rollout.seeded`` its k-th
        request (turn k) carries ``sampling_seed = request_seed(trainer.seed, phase, step,
        episode_id, k)``, so the episode's tokens depend only on the step and the weights, not on
        what else the engines are running (the data cursor of a resumed run is the step)."""
        if not self.cfg.rollout.seeded:
            return self.engines.generate
        turns = itertools.count(1)
        key = (self.cfg.trainer.seed, "eval" if evaluate else "train", step, episode_id)

        async def generate(prompt_ids, sampling):
            seed = request_seed(*key, next(turns))
            return await self.engines.generate(prompt_ids, {**sampling, "sampling_seed": seed})
        return generate

    def train_step(self, step: int) -> dict[str, float]:
        cfg, metrics = self.cfg, {}
        t0 = time.perf_counter()
        episodes, rollout_s = self.rollout(step)
        if cfg.trainer.colocate:  # the engines give the shared devices to the trainer phase
            self.engines.release_memory()
        metrics.update(summarize(episodes, "rollout"))
        samples, filter_metrics = filter_groups([s for e in episodes for s in e.samples],
                                                cfg.filter.ratio, cfg.filter.mode)
        metrics.update(filter_metrics)
        # the echo-trap signal: mean in-group reward std of all groups, and of the kept ones
        metrics["rollout/group_reward_std_before_filter"] = filter_metrics["filter/in_group_std"]
        metrics["rollout/group_reward_std_after_filter"] = filter_metrics["filter/chosen_in_group_std"]
        batch = build_batch(samples, pad_id=self.tokenizer.pad_token_id)
        t1 = time.perf_counter()
        if cfg.algo.use_rollout_logprobs:
            batch["old_logprobs"] = batch["rollout_logprobs"]
        else:
            batch["old_logprobs"] = self.actor.compute_logprobs(batch)
            mask = batch["loss_mask"].bool()
            metrics["train/rollout_vs_trainer_logprob_diff"] = float(
                (batch["old_logprobs"] - batch["rollout_logprobs"])[mask].abs().mean())
        values = None
        if self.critic is not None:
            values = self.critic.compute_values(batch)
            batch["old_values"] = values
        batch = compute_advantages(batch, estimator=cfg.algo.adv_estimator, gamma=cfg.algo.gamma,
                                   lam=cfg.algo.lam, reward_norm=cfg.algo.reward_norm,
                                   grpo_norm_by_std=cfg.algo.grpo_norm_by_std,
                                   token_values=values)
        if self.critic is not None:
            metrics.update(self.critic.train(batch))
        metrics.update(self.actor.train(batch))
        t2 = time.perf_counter()
        metrics.update(self.sync_weights(step))
        t3 = time.perf_counter()
        if cfg.trainer.check_weight_sync:
            metrics["sync/max_logprob_diff"] = self.check_weight_sync()
        tokens = int(batch["attention_mask"].sum())
        metrics.update({"time/rollout_s": rollout_s, "time/train_s": t2 - t1,
                        "time/sync_s": t3 - t2, "time/step_s": t3 - t0,
                        "time/train_tokens_per_s": tokens / max(t2 - t1, 1e-9),
                        "train/batch_samples": float(len(samples)),
                        "weight_version": float(step)})
        return metrics

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the actor's weights into every engine as ``version``. Colocated engines are
        released at this point (after start-up, and after each rollout): they take their weight
        memory back first and their KV cache only once the weights are in (slime's order)."""
        if self.cfg.trainer.colocate:
            self.engines.resume_memory(["weights"])
        metrics = self.actor.sync_weights(version)
        if self.cfg.trainer.colocate:
            self.engines.resume_memory(["kv_cache"])
        return metrics

    def check_weight_sync(self) -> float:
        """Max |engine - trainer| log-prob over a greedy completion of a fixed prompt, on every
        engine (slime's check-weight-update-equal): near 0 iff the engines serve the trainer's
        weights."""
        prompt = self.tokenizer.encode("Which slot machine pays more, Phoenix or Dragon?",
                                       add_special_tokens=False)
        sampling = {"temperature": 0.0, "max_new_tokens": 8}

        async def ask_all():
            try:
                return await asyncio.gather(*(self.engines.generate(prompt, sampling, engine=i)
                                              for i in range(len(self.engines.urls))))
            finally:
                await self.engines.close_clients()

        worst = 0.0
        for gen in asyncio.run(ask_all()):
            ids = torch.tensor([prompt + gen.output_ids])
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                     "loss_mask": torch.zeros(ids.shape)}
            trainer = self.actor.compute_logprobs(batch)[0, len(prompt):]
            worst = max(worst, float((trainer - torch.tensor(gen.logprobs)).abs().max()))
        return worst

    def evaluate(self) -> dict[str, float]:
        episodes, seconds = self.rollout(0, evaluate=True)
        return {**summarize(episodes, "val"), "time/eval_s": seconds}

    def data_cursor(self) -> dict:
        """What, besides the step, decides the episodes and samples of a step (env seeds and
        sampling seeds are functions of these and the step)."""
        return {"env.seed": self.cfg.env.seed, "trainer.seed": self.cfg.trainer.seed,
                "rollout.seeded": self.cfg.rollout.seeded}

    def save(self, step: int) -> None:
        """Actor (and critic) checkpoints for ``step``, then the pointer that makes it complete.
        Their extra state: the step, the data cursor and the driver's RNG states."""
        root = Path(self.cfg.trainer.run_dir) / "checkpoints"
        extra = {"step": step, "data_cursor": self.data_cursor(), "rng": rng_states()}
        self.actor.save_checkpoint(str(root / "actor"), extra)
        if self.critic is not None:
            self.critic.save_checkpoint(str(root / "critic"), extra)
        tmp = root / f".{LATEST}.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, root / LATEST)

    def resume(self) -> int:
        """The step to continue after (0 = fresh start), loading its checkpoints."""
        mode = self.cfg.trainer.resume
        root = Path(self.cfg.trainer.run_dir) / "checkpoints"
        if mode == "never" or (mode == "auto" and not (root / LATEST).exists()):
            return 0
        if mode == "auto":
            step = int((root / LATEST).read_text())
            actor_dir, critic_dir = root / "actor" / f"step_{step}", root / "critic" / f"step_{step}"
        else:
            actor_dir, critic_dir = Path(mode) / "actor", Path(mode) / "critic"
        extra = self.actor.load_checkpoint(str(actor_dir))
        if self.critic is not None:
            self.critic.load_checkpoint(str(critic_dir))
        step = int(extra["step"])
        if "rng" in extra:  # checkpoints from before RNG states were saved have none
            set_rng_states(extra["rng"])
        saved = extra.get("data_cursor", {})
        changed = [f"{k}={saved[k]!r} (now {v!r})" for k, v in self.data_cursor().items()
                   if k in saved and saved[k] != v]
        if changed:
            warnings.warn(f"trainer.resume: step {step}'s checkpoint was written with "
                          f"{', '.join(changed)}; the resumed steps will not replay the "
                          f"uninterrupted run's")
        return step


def bundle_cpus(cluster_cpus: float, n_bundles: int, n_env_workers: int,
                use_gpu: bool) -> tuple[float, float]:
    """CPUs reserved by each trainer-rank/engine bundle and by each env-worker bundle. On GPU: a
    core each, so many env workers spread over the cluster's CPUs. On CPU the whole run shares the
    machine: an env worker reserves a quarter of what a trainer rank or engine does (it is busy
    only between generations), rounded down to Ray's resource unit (1e-4) so the sum fits."""
    if use_gpu:
        return 1.0, 1.0
    cpus = min(1.0, math.floor(cluster_cpus / (n_bundles + n_env_workers / 4) * 1e4) / 1e4)
    return cpus, math.floor(cpus / 4 * 1e4) / 1e4


def build_run(cfg: RunConfig) -> Run:
    """Start Ray (or join it), place engines and trainers, connect the weight sync."""
    from transformers import AutoTokenizer

    from ragen_mega.ray.cluster import init_ray
    from ragen_mega.ray.engine_group import EngineGroup
    from ragen_mega.ray.env_workers import EnvWorkerGroup
    from ragen_mega.ray.placement import create_placement_group, plan_placement
    from ragen_mega.ray.trainer_group import TrainerGroup

    model_dir = resolve_model(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    init_ray(cfg.trainer.ray_address)
    import ray

    use_gpu = torch.cuda.is_available()
    actor_world = cfg.actor.tp * cfg.actor.pp * cfg.trainer.data_parallel
    critic_world = cfg.critic.tp * cfg.critic.pp * cfg.trainer.data_parallel if cfg.critic.enable else 0
    n_bundles = actor_world + critic_world + (0 if cfg.trainer.colocate else
                                              cfg.rollout.num_engines * cfg.rollout.engine_tp)
    n_env = cfg.rollout.env_workers
    cpus, env_cpus = bundle_cpus(ray.cluster_resources().get("CPU", 1), n_bundles, n_env, use_gpu)
    plan = plan_placement(num_trainer_ranks=actor_world + critic_world,
                          num_engines=cfg.rollout.num_engines, engine_tp=cfg.rollout.engine_tp,
                          colocate=cfg.trainer.colocate, use_gpu=use_gpu, cpus_per_bundle=cpus,
                          num_env_workers=n_env, cpus_per_env_worker=env_cpus)
    pg = create_placement_group(plan)
    run_dir = Path(cfg.trainer.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    engines = EngineGroup(model_dir, pg, plan.engine_bundles, tp=cfg.rollout.engine_tp,
                          dtype=cfg.model.dtype, log_dir=str((run_dir / "logs").resolve()),
                          num_cpus=cpus / 2 if cfg.trainer.colocate else cpus,
                          seeded_sampling=cfg.rollout.seeded,
                          memory_saver=cfg.trainer.colocate, mem_fraction=cfg.rollout.mem_fraction)
    if cfg.trainer.colocate:  # the trainer ranks about to be built need the shared devices
        engines.release_memory()
    trainer_cpus = cpus / 2 if cfg.trainer.colocate else cpus
    gpus = 0.5 if (use_gpu and cfg.trainer.colocate) else (1.0 if use_gpu else 0.0)
    total = cfg.trainer.total_steps
    actor_cfg = dataclasses.replace(cfg.actor, total_steps=max(total, cfg.actor.warmup_steps + 1),
                                    temperature=max(cfg.rollout.temperature, 1e-6),
                                    seed=cfg.trainer.seed)
    # Ray gives an actor with a fractional CPU one OpenMP thread; on CPU the phases (rollout,
    # critic, actor) run one after another, so each trainer rank may use the cores it shares.
    threads = None if use_gpu else max(1, (os.cpu_count() or 1) // max(actor_world, critic_world))
    actor = TrainerGroup("actor", model_dir, actor_cfg, pg, plan.trainer_bundles[:actor_world],
                         num_cpus=trainer_cpus, num_gpus=gpus, threads=threads)
    critic = None
    if cfg.critic.enable:
        critic_cfg = dataclasses.replace(cfg.critic, seed=cfg.trainer.seed,
                                         total_steps=max(total, cfg.critic.warmup_steps + 1))
        critic = TrainerGroup("critic", model_dir, critic_cfg, pg,
                              plan.trainer_bundles[actor_world:], num_cpus=trainer_cpus,
                              num_gpus=gpus, threads=threads)
    actor.connect_engines(engines.urls, engines.tp_sizes,
                          mode="tensor" if cfg.trainer.colocate else "distributed",
                          bucket_bytes=cfg.trainer.sync_bucket_mb << 20)
    env_workers = (EnvWorkerGroup(pg, plan.env_worker_bundles, num_cpus=env_cpus)
                   if n_env else None)
    return Run(cfg, model_dir, tokenizer, engines, actor, critic, pg, env_workers)


def train(cfg: RunConfig) -> list[dict[str, float]]:
    """Run the loop; returns every step's metrics (also in TensorBoard and metrics.jsonl)."""
    from ragen_mega.logging import RunLogger

    run = build_run(cfg)
    run_dir = Path(cfg.trainer.run_dir)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    logger = RunLogger(run_dir / "tensorboard", cfg.trainer.total_steps, cfg.echo_trap)
    history = []
    try:
        start = run.resume()
        run.sync_weights(start)  # engines serve exactly the trainer's weights from now on
        if start == 0 and cfg.trainer.eval_every:
            logger.log(0, run.evaluate())
        for step in range(start + 1, cfg.trainer.total_steps + 1):
            metrics = run.train_step(step)
            if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
                metrics.update(run.evaluate())
            logger.log(step, metrics)
            history.append({"step": step, **metrics})
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
            last = step == cfg.trainer.total_steps
            if last or (cfg.trainer.save_every and step % cfg.trainer.save_every == 0):
                run.save(step)
    finally:
        logger.close()
        run.shutdown()
    return history


def main(argv: list[str] | None = None) -> int:
    """``ragen-mega train CONFIG.yaml [key=value ...]``"""
    import argparse

    parser = argparse.ArgumentParser(prog="ragen-mega train", description=main.__doc__)
    parser.add_argument("config", help="YAML config file (see examples/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.lr=1e-6")
    args = parser.parse_args(argv)
    from ragen_mega.config_tree import ConfigError

    try:
        cfg = load_run_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"ragen-mega train: config error: {e}", file=sys.stderr)
        return 2
    train(cfg)
    return 0
