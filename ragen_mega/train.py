"""``ragen-mega train CONFIG [key=value ...]``: the StarPO / StarPO-S training loop, top to bottom.

One step, as docs/design.md draws it::

    rollout (rollout/manager.py: all episodes at once on the SGLang engines, or the streams' window)
      -> StarPO-S filter -> batch (one row per turn, or one per episode when packed)
      -> old log-probs (actor) and values (critic) -> advantages (algo/estimators.py, by name)
      -> critic update -> actor update -> weight sync into the engines -> log -> checkpoint

In the critic's warm-up (the first ``critic.warmup_steps`` steps) the actor is not trained (its
optimizer and LR schedule do not move; ``train/actor_frozen`` is 1, no ``actor/*`` scalars). The
sync still pushes the unchanged weights under the step's version: colocated engines drop their
weights for the train phase and must get them back, and weight versions stay the loop's steps.

With ``async_mode: one_step_off`` step k+1's rollout plays on the engines (another thread) while
step k trains, and is waited for before the sync: an engine must not change weights under a
request. An engine restarted during that overlapped rollout gets the trainer's weights in the
sync, on this thread, and step k+1's rollout is then played again after it.

:func:`~ragen_mega.ray.run.build_run` places the pieces; :func:`train` is the loop. Resuming
(``trainer.resume=auto``, ``checkpoints.py``) restarts after the newest complete step, and a
resumed step replays the uninterrupted run's. SIGUSR1 or SIGTERM (slurm's warning before
preemption or the time limit) stops the loop after the step under way, saved
(``preemption.py``).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from ragen_mega.algo.advantages import advantage_metrics, kl_penalized_rewards
from ragen_mega.algo.estimators import compute_advantages
from ragen_mega.algo.losses import episode_loss_tokens, kl_penalty
from ragen_mega.algo.filter import FILTER_SETTINGS
from ragen_mega.algo.gigpo import step_group_metrics
from ragen_mega.config import RunConfig, load_run_config
from ragen_mega.preflight import preflight
from ragen_mega.config_tree import ConfigError
from ragen_mega import checkpoints, preemption, progress, run_intent, trajectories
from ragen_mega.evaluate import REFERENCES_FILE, held_out_references
from ragen_mega.logging import append_metrics, timed
from ragen_mega.ray.sync_check import max_logprob_diff
from ragen_mega.rollout.batch import Filtered, build_batch, cut_value_batch, filter_groups
from ragen_mega.rollout.collapse_probe import first_turn_probe, valid_thinking_rate
from ragen_mega.rollout.manager import PlayedStep
from ragen_mega.rollout.packing import layouts_agree, pack_trajectories
from ragen_mega.rollout.replay import ReplayedRollouts, save_rollout
from ragen_mega.rollout.source import open_rollout_source
from ragen_mega.run_dir_lock import RunDirInUse, holding_run_dir

if TYPE_CHECKING:
    from ragen_mega.ray.run import Run


def train(cfg: RunConfig) -> list[dict[str, float]]:
    """Run the loop; returns every step's metrics (also in TensorBoard and metrics.jsonl).
    Raises :class:`~ragen_mega.preemption.Preempted` after a stop signal (SIGUSR1/SIGTERM),
    once the step under way is checkpointed and the run's processes are stopped."""
    from ragen_mega.logging import RunLogger
    from ragen_mega.ray.cluster import init_ray
    from ragen_mega.ray.run import build_run

    run_dir = Path(cfg.trainer.run_dir)
    with holding_run_dir(run_dir):  # before anything is written: one run per run directory
        plan = run_intent.start_plan(cfg)  # ConfigChanged: before any process starts
        progress.say(plan.message)
        if plan.complete:
            return []
        progress.say(f"writing to {run_dir} (metrics.jsonl, checkpoints/, trajectories/)"
                     + (f"; watch: tensorboard --logdir {run_dir / 'tensorboard'}"
                        if "tensorboard" in cfg.trainer.loggers else ""))
        init_ray(cfg.trainer.ray_address)  # first: ray.init puts its own handler on SIGTERM
        progress.say("Ray ready")
        replay = cfg.trainer.replay_rollouts
        with preemption.stop_on_signals() as stop, \
                build_run(cfg, with_engines=replay is None) as run:
            if replay is not None:  # the saved rollouts, in place of engines
                run.rollouts = ReplayedRollouts(replay, run_dir / "faults.jsonl")
            run_intent.record_start(cfg, plan)
            write_references(cfg, run_dir)
            logger = RunLogger(run_dir, cfg.trainer.total_steps, cfg.echo_trap,
                               loggers=cfg.trainer.loggers, config=run_intent.config_record(cfg),
                               resume=plan.resume_step is not None)
            try:
                return run_loop(cfg, run, logger, stop)
            finally:
                logger.close()


def write_references(cfg: RunConfig, run_dir: Path) -> None:
    """``RUN_DIR/references.json``: the held-out reference lines (``{"references": ...,
    "per_tag": ...}``, as ``ragen-mega eval --out`` writes them) that ``ragen-mega plot`` draws;
    not written when the run does not evaluate or its envs have none."""
    if not cfg.trainer.eval_every:
        return
    lines, per_tag = held_out_references(cfg)
    if per_tag:
        payload = {**({"references": lines} if lines else {}), "per_tag": per_tag}
        (run_dir / REFERENCES_FILE).write_text(json.dumps(payload, indent=2) + "\n")


def run_loop(cfg: RunConfig, run: Run, logger, stop: preemption.StopRequest
             ) -> list[dict[str, float]]:
    """Resume, then step until ``trainer.total_steps`` or until ``stop`` is requested: the step
    under way is finished and saved, then :class:`~ragen_mega.preemption.Preempted`."""
    t, run_dir = cfg.trainer, Path(cfg.trainer.run_dir)
    history = []
    # pending: the rollout of step start + 1 that a one_step_off checkpoint kept
    start, saved_rollout, pending = checkpoints.resume(cfg, run.actor, run.critic)
    run.rollouts.load_state_dict(saved_rollout)
    run.sync_weights(start)  # engines serve exactly the trainer's weights from now on
    source = (f"step {start}'s checkpoint" if start else
              f"actor.load ({cfg.actor.load})" if cfg.actor.load else
              f"model.path ({cfg.model.path})")
    progress.say(f"trainer ranks ready; the weights of {source} synced into the engines")
    if start == 0 and t.eval_every:  # step 0: the start weights, the base of every curve
        metrics = evaluate(cfg, run, 0)
        progress.say("step-0 evaluation done")
        logger.log(0, metrics)
        append_metrics(run_dir, 0, metrics)
    run.source = open_rollout_source(cfg, run, start=start, pending=pending)
    try:
        for step in range(start + 1, t.total_steps + 1):
            if stop.requested:  # signalled before the first step: the resumed checkpoint is newest
                raise preemption.Preempted(stop.signal_name, start)
            metrics = train_step(cfg, run, step, run.source.take(step))
            if t.eval_every and step % t.eval_every == 0:
                metrics.update(evaluate(cfg, run, step))
            # a step whose updates kept failing is logged, never saved (skipped_updates_error)
            failed = skipped_updates_error(metrics, t.max_skipped_updates_in_row)
            last = step == t.total_steps
            if failed is None and (last or stop.requested or
                                   (t.save_every and step % t.save_every == 0)):
                with timed(metrics, "time/save_s"):
                    checkpoints.save(cfg, step, run.actor, run.critic,
                                     **run.source.state_dict())
            logger.log(step, metrics)
            history.append({"step": step, **metrics})
            append_metrics(run_dir, step, metrics)
            if failed is not None:
                raise failed
            if stop.requested and not last:
                raise preemption.Preempted(stop.signal_name, step)
    finally:
        run.source.stop()
    return history


def train_step(cfg: RunConfig, run: Run, step: int, played: PlayedStep) -> dict[str, float]:
    """Train on ``played`` (step ``step``'s rollout), then sync; the step's metrics.
    ``run.source`` (the rollouts' :class:`~ragen_mega.rollout.source.RolloutSource`) finishes
    what plays on the old weights before the sync, and learns of the new ones at the end."""
    t0 = time.perf_counter()
    metrics = dict(played.metrics)
    if run.engines is not None:  # colocated ones give the shared devices to the trainer phase
        run.engines.release_memory()
    t1 = time.perf_counter()
    every = cfg.trainer.collapse_every
    if every and (step == 1 or step % every == 0):  # RAGEN's schedule: step 1, then every k
        with timed(metrics, "time/probe_s"):
            metrics.update(probe_collapse(cfg, run, played.samples, step))
    update = update_models(cfg, run, step, played, metrics)
    t2 = time.perf_counter()
    if cfg.trainer.save_rollouts:
        save_rollout(cfg.trainer.run_dir, step, played)
    if cfg.trainer.save_trajectories:
        with timed(metrics, "time/trajectories_s"):
            save_step_trajectories(cfg, run, step, played, update)
    run.source.before_sync(metrics)
    t_sync = time.perf_counter()
    metrics.update(run.sync_weights(step))
    t3 = time.perf_counter()
    if cfg.trainer.check_weight_sync:
        metrics["sync/max_logprob_diff"] = max_logprob_diff(run.engines, run.actor, run.tokenizer)
    tokens = 0 if update.train is None else int(update.train["attention_mask"].sum())
    metrics.update({"time/rollout_s": played.rollout_s, "time/train_s": t2 - t1,
                    "time/sync_s": t3 - t_sync, "time/step_s": t3 - t0,
                    "time/train_tokens_per_s": tokens / max(t2 - t1, 1e-9),
                    "train/batch_samples": float(len(update.filtered.samples)),
                    "train/batch_tokens": float(tokens),
                    "weight_version": float(step), **played.faults.metrics()})
    if run.engines is not None:  # none in a replayed run
        metrics.update(run.engines.supervisor.take_fault_counts())  # since the previous step's
    run.source.after_sync(step)   # last: the steps it admits now start after this one ends
    return metrics


class Update(NamedTuple):
    """What a step trained on: the trained layout (None: the filter kept no group), the
    filter's result, and the per-turn batch of the kept samples with their advantages (and,
    for a streamed step's cut turns, ``bootstrap_values``)."""
    train: dict[str, torch.Tensor] | None
    filtered: Filtered
    per_turn: dict[str, torch.Tensor] | None


def update_models(cfg: RunConfig, run: Run, step: int, played: PlayedStep,
                  metrics: dict[str, float]) -> Update:
    """Filter, batch, old log-probs and values, advantages, then the critic's and the actor's
    updates (``metrics`` gains theirs). When the filter keeps no group (RAGEN skips such a step
    too: ``top_p`` linear keeps nothing when no group's score is above 0) neither model moves."""
    filtered = filter_groups(played.samples, by_stream=played.window is not None,
                             **{key: getattr(cfg.filter, key) for key in FILTER_SETTINGS})
    samples, weights = filtered.samples, filtered.weights
    metrics.update(filtered.metrics)
    if not samples:  # the filter found no group worth training on: no update this step
        return Update(None, filtered, None)
    batch = build_batch(samples, pad_id=run.tokenizer.pad_token_id,
                        state_similarity=cfg.algo.gigpo_similarity)
    agg_modes = [cfg.actor.loss_agg_mode] + (
        [cfg.critic.loss_agg_mode] if cfg.critic.enable else [])
    layout = pack_trajectories(samples, batch, enabled=layouts_agree(
        cfg.trainer.pack_trajectories, agg_modes))
    train = layout.batch  # what actor and critic see; the estimators read the per-turn batch
    train["episode_loss_tokens"] = episode_loss_tokens(train["loss_mask"], train["episode_id"])
    metrics.update(layout.metrics)
    if cfg.algo.use_rollout_logprobs:
        train["old_logprobs"] = train["rollout_logprobs"]
    else:
        with timed(metrics, "time/old_logprobs_s"):
            train["old_logprobs"] = run.actor.compute_logprobs(train)
        mask = train["loss_mask"].bool()
        metrics["train/rollout_vs_trainer_logprob_diff"] = float(
            (train["old_logprobs"] - train["rollout_logprobs"])[mask].abs().mean())
    if cfg.algo.kl_in_reward:
        kl_into_rewards(cfg, run, train, batch, layout.to_per_turn, metrics)
    values = None
    if run.critic is not None:
        with timed(metrics, "time/values_s"):
            train["old_values"] = run.critic.compute_values(train)
        values = layout.to_per_turn(train["old_values"])
    if played.window is not None and run.critic is not None:   # critic-free: no bootstrap
        batch["bootstrap_values"] = cut_values(cfg, run, samples, played.window)
    batch = compute_advantages(batch, cfg.algo, token_values=values,
                               bootstrap_values=batch.get("bootstrap_values"))
    if not bool((weights == 1).all()):  # filter.loss_scaling, filter.soft_reweight
        batch["advantages"] = batch["advantages"] * weights[:, None]
    metrics.update(advantage_metrics(batch["advantages"], batch["loss_mask"]))
    if "step_advantages" in batch:
        metrics.update(step_group_metrics(batch["state_group"], batch["step_advantages"]))
    for key in ("advantages", "returns"):
        if key in batch:
            train[key] = layout.to_train(batch[key])
    if run.critic is not None:
        with timed(metrics, "time/critic_update_s"):
            metrics.update(run.critic.train(train))
    actor_frozen = step <= cfg.critic.warmup_steps  # critic warm-up: no actor/* this step
    if not actor_frozen:
        with timed(metrics, "time/actor_update_s"):
            metrics.update(run.actor.train(train))
    metrics["train/actor_frozen"] = float(actor_frozen)
    for role in ("actor", "critic"):
        if metrics.get(f"{role}/updates_skipped"):
            played.faults.record("updates_skipped", int(metrics[f"{role}/updates_skipped"]),
                                 role=role, reason="NaN or inf in the loss or the gradients")
    return Update(train, filtered, batch)


def evaluate(cfg: RunConfig, run: Run, step: int) -> dict[str, float]:
    """The held-out evaluation of the weights after step ``step``: its metrics, and its
    episodes in ``eval_step_N.jsonl.gz`` (``trainer.save_trajectories``)."""
    metrics, samples = run.rollouts.evaluate()
    for sample in samples:
        sample.weight_version = step
    if cfg.trainer.save_trajectories:
        trajectories.write_records(
            trajectories.step_file(cfg.trainer.run_dir, step, "eval"),
            trajectories.episode_records(samples, run.tokenizer, kind="eval", step=step,
                                         groups=cfg.trainer.trajectory_samples))
    return metrics


def save_step_trajectories(cfg: RunConfig, run: Run, step: int, played: PlayedStep,
                           update: Update) -> None:
    """Step ``step``'s episodes, with the filter's verdict and the credit each turn got, in
    ``RUN_DIR/trajectories/step_N.jsonl.gz`` (``trajectories.py``)."""
    per_turn = update.per_turn or {}
    records = trajectories.episode_records(
        played.samples, run.tokenizer, kind="train", step=step,
        scores=update.filtered.scores, kept=update.filtered.samples,
        advantages=per_turn.get("advantages"), step_advantages=per_turn.get("step_advantages"),
        bootstrap=per_turn.get("bootstrap_values"), groups=cfg.trainer.trajectory_samples)
    trajectories.write_records(trajectories.step_file(cfg.trainer.run_dir, step), records)


def probe_collapse(cfg: RunConfig, run: Run, samples: list, step: int) -> dict[str, float]:
    """RAGEN-2's collapse probes on the step's rollout (``rollout/collapse_probe.py``), scored
    by the actor before its update; ``collapse/valid_thinking_rate`` always, the cross-scored
    metrics when there are two groups and a reasoning to score."""
    metrics = {"collapse/valid_thinking_rate": valid_thinking_rate(samples, run.tokenizer)}
    probe = first_turn_probe(samples, run.tokenizer, max_samples=cfg.trainer.collapse_samples,
                             seed=cfg.trainer.seed * 1_000_003 + step,
                             rows_multiple_of=cfg.trainer.data_parallel)
    if probe is not None:
        metrics.update(probe.metrics(run.actor.compute_logprobs(probe.batch)))
    return metrics


def kl_into_rewards(cfg: RunConfig, run: Run, train: dict, batch: dict, to_per_turn,
                    metrics: dict[str, float]) -> None:
    """``algo.kl_in_reward``: the per-turn ``batch["reward"]`` less the turn's KL between the
    rollout policy (the old log-probs) and the actor's reference model (``algo/advantages.py``:
    ``kl_penalized_rewards``); ``algo/kl_in_reward`` is the mean turn KL."""
    token_kl = kl_penalty(train["old_logprobs"], run.actor.compute_ref_logprobs(train),
                          cfg.actor.kl_kind)
    batch["reward"], turn_kl = kl_penalized_rewards(batch["reward"], to_per_turn(token_kl),
                                                    batch["loss_mask"], cfg.algo.kl_in_reward)
    metrics["algo/kl_in_reward"] = float(turn_kl.mean())


def cut_values(cfg: RunConfig, run: Run, samples: list, window) -> torch.Tensor:
    """[B]: at each cut sample the critic's value of the state after the cut (its next
    prompt, valued and never trained on), 0 elsewhere."""
    out = torch.zeros(len(samples))
    cut = cut_value_batch(samples, window.next_prompts, run.tokenizer.pad_token_id,
                          rows_multiple_of=cfg.trainer.data_parallel)
    if cut is not None:
        inputs, rows, columns = cut
        values = run.critic.compute_values(inputs)
        out[rows] = values[torch.arange(len(rows)), columns].float()
    return out


def skipped_updates_error(metrics: dict[str, float], limit: int) -> RuntimeError | None:
    """The error that ends the run once the actor or the critic has skipped ``limit`` updates
    in a row (``trainer.max_skipped_updates_in_row``), or None: the loop raises it after logging
    the step and without saving it, so the newest checkpoint is the last good one."""
    for role in ("actor", "critic"):
        in_row = metrics.get(f"{role}/updates_skipped_in_row", 0)
        if in_row >= limit:
            return RuntimeError(
                f"{role}: {int(in_row)} updates in a row had a NaN or inf loss or gradient "
                f"(trainer.max_skipped_updates_in_row={limit}); the run stops, its newest "
                f"checkpoint is the last good one")
    return None


def main(argv: list[str] | None = None) -> int:
    """``ragen-mega train CONFIG.yaml [key=value ...]``"""
    import argparse

    parser = argparse.ArgumentParser(prog="ragen-mega train", description=main.__doc__)
    parser.add_argument("config", help="YAML config file (see examples/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.lr=1e-6")
    args = parser.parse_args(argv)
    progress.restart_clock()
    try:
        cfg = preflight(load_run_config(args.config, args.overrides))
    except ConfigError as e:
        print(f"ragen-mega train: config error: {e}", file=sys.stderr)
        return 2
    try:
        train(cfg)
    except (run_intent.ConfigChanged, RunDirInUse) as e:
        print(f"ragen-mega train: {e}", file=sys.stderr)
        return 2
    except preemption.Preempted as stopped:
        print(f"ragen-mega train: {stopped}", file=sys.stderr, flush=True)
        return preemption.PREEMPTED_EXIT_CODE
    return 0
