"""``ragen-mega sft CONFIG [key=value ...]``: a supervised warm start on the RL trainer.

Small models often write few parseable answers before RL, so RL spends its first steps, and its
only varying reward, on the answer format. slime, verl and OpenRLHF ship an SFT stage for that;
this one runs on the actor's Megatron trainer (``actor`` section: TP/PP, micro-batches, Adam;
``trainer.data_parallel``, ``trainer.seed``), placed by Ray with no engine.

Data (``sft.data``, :mod:`ragen_mega.sft_data`): ``format``, the env's own first-turn prompts
(exactly what the rollout sends) with a uniformly random valid answer, which teaches the format
and nothing about the solution; or a JSONL file of chats. The loss (:class:`SFTObjective`) is the
token-mean negative log-likelihood of the target tokens, or with ``sft.prompt_loss`` of every
token (a model trained from scratch then keeps the board in its states). ``sft.steps`` steps of
``sft.batch_size`` examples (epochs of a seeded shuffle); the held-out loss on ``sft.heldout``
examples every ``sft.eval_every`` steps and at the first and last. Scalars ``sft/loss``,
``sft/heldout_loss``, ``sft/entropy``, ``sft/grad_norm``, ``sft/lr`` go to ``metrics.jsonl`` and
``trainer.loggers`` (each sft run is a new wandb / MLflow run). The weights end as a Megatron
checkpoint (``trainer.run_dir/checkpoints/sft``) and a Hugging Face directory (``sft.out``,
default ``trainer.run_dir/hf``) that ``train`` and ``eval`` take as ``model.path``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ragen_mega import progress
from ragen_mega.algo.objectives import SFTObjective
from ragen_mega.config import RunConfig, load_run_config
from ragen_mega.preflight import preflight
from ragen_mega.config_tree import ConfigError
from ragen_mega.run_dir_lock import RunDirInUse, holding_run_dir

#: the trainer's metric -> the name sft logs it under
_METRICS = {"actor/loss": "sft/loss", "actor/entropy": "sft/entropy",
            "actor/grad_norm": "sft/grad_norm", "actor/lr": "sft/lr"}


def output_dir(cfg: RunConfig) -> Path:
    return Path(cfg.sft.out) if cfg.sft.out else Path(cfg.trainer.run_dir) / "hf"


def check(cfg: RunConfig) -> None:
    """What must hold before anything starts (a ConfigError naming the key): whole micro-batches
    on every data-parallel rank, an output directory that does not hold anything yet."""
    rows = cfg.actor.micro_batch_size * cfg.trainer.data_parallel
    if cfg.actor.max_tokens_per_micro_batch is None and cfg.sft.batch_size % rows:
        raise ConfigError(f"sft.batch_size: must be a multiple of actor.micro_batch_size x "
                          f"trainer.data_parallel = {rows}, got {cfg.sft.batch_size}")
    out = output_dir(cfg)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"sft.out: {out} exists and is not empty (the warm-started model is "
                          f"written there; give a new directory)")


def load_examples(cfg: RunConfig, tokenizer) -> tuple[list, list]:
    """(training, held-out) examples of ``sft.data``; with ``sft.prompt_loss`` the training
    examples' loss is on every token but the first (nothing predicts it)."""
    from ragen_mega import sft_data

    s = cfg.sft
    if s.data == "format":
        examples = sft_data.format_examples(cfg, tokenizer, s.examples + s.heldout, s.seed)
    else:
        examples = sft_data.load_chats(s.data, tokenizer)
        if len(examples) <= s.heldout:
            raise ConfigError(f"sft.heldout: {s.data} has {len(examples)} chats, not more than "
                              f"sft.heldout={s.heldout}")
    train = examples[:-s.heldout]
    if s.prompt_loss:
        train = [sft_data.SFTExample(e.ids, [0] + [1] * (len(e.ids) - 1)) for e in train]
    return train, examples[-s.heldout:]


def batches(examples: list, batch_size: int, seed: int) -> Iterator[list]:
    """Endless batches: each epoch a new seeded shuffle, its batches in order; a batch may wrap
    into the next epoch."""
    rng, order = np.random.default_rng(seed), []
    while True:
        while len(order) < batch_size:
            order += rng.permutation(len(examples)).tolist()
        yield [examples[i] for i in order[:batch_size]]
        order = order[batch_size:]


def heldout_loss(actor, batch: dict[str, torch.Tensor]) -> float:
    """Token-mean negative log-likelihood of the held-out targets under the actor's weights."""
    logprobs = actor.compute_logprobs(batch)
    mask = batch["loss_mask"]
    return float(-(logprobs * mask).sum() / mask.sum())


@contextlib.contextmanager
def placed_actor(cfg: RunConfig, model_dir: str, total_steps: int):
    """The actor's Megatron ranks (no engine), minimising :class:`SFTObjective`; stopped, and
    their placement group removed, on leaving the block."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from ragen_mega.ray.placement import create_placement_group, plan_resources
    from ragen_mega.ray.trainer_group import TrainerGroup

    res = plan_resources(cfg, cluster_cpus=ray.cluster_resources().get("CPU", 1),
                         host_cpus=os.cpu_count() or 1, use_gpu=torch.cuda.is_available(),
                         with_engines=False)
    pg = create_placement_group(res.placement)
    try:
        actor = TrainerGroup("actor", model_dir, cfg.actor, pg, res.actor_bundles,
                             num_cpus=res.trainer_cpus, num_gpus=res.trainer_gpus,
                             threads=res.trainer_threads, seed=cfg.trainer.seed,
                             objective=SFTObjective(), total_steps=total_steps)
        try:
            yield actor
        finally:
            actor.kill()
    finally:
        remove_placement_group(pg)


@dataclasses.dataclass
class Prepared:
    """What an SFT run needs before any process starts (:func:`prepare`)."""
    cfg: RunConfig
    model_dir: str
    pad_id: int
    train: list
    heldout: list


def prepare(cfg: RunConfig) -> Prepared:
    """The run's effective config (``sft.lr``; one update a step: the whole batch, one epoch,
    so the RL mini-batch knobs do not apply), checked, and its examples tokenized; bad input
    fails here (ConfigError, FileNotFoundError, ValueError naming the key or file line)."""
    from transformers import AutoTokenizer

    from ragen_mega.models.prepare import resolve_model

    s = cfg.sft
    cfg = dataclasses.replace(cfg, actor=dataclasses.replace(
        cfg.actor, lr=cfg.actor.lr if s.lr is None else s.lr, ppo_mini_batch_size=None,
        ppo_epochs=1, lr_warmup_steps=min(cfg.actor.lr_warmup_steps, s.steps - 1)))
    check(cfg)
    model_dir = resolve_model(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_examples, heldout = load_examples(cfg, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Prepared(cfg, model_dir, pad_id, train_examples, heldout)


def run(p: Prepared) -> list[dict[str, float]]:
    """Train (module doc); returns every logged step's metrics (step 0: the held-out loss of
    the start weights) and leaves the Hugging Face directory at :func:`output_dir`."""
    from ragen_mega.backends.megatron.convert import megatron_to_hf
    from ragen_mega.backends.megatron.train import pad_rows
    from ragen_mega.logging import RunLogger, append_metrics
    from ragen_mega.ray.cluster import init_ray
    from ragen_mega.run_intent import config_record
    from ragen_mega.sft_data import collate_examples

    cfg, s = p.cfg, p.cfg.sft
    # padded with loss-free copies of the first example to whole micro-batches on every rank
    held = pad_rows(collate_examples(p.heldout, p.pad_id),
                    cfg.actor.micro_batch_size * cfg.trainer.data_parallel)
    run_dir = Path(cfg.trainer.run_dir)
    with holding_run_dir(run_dir, "sft"):  # a second job in this directory exits here
        init_ray(cfg.trainer.ray_address)
        progress.say("Ray ready")
        logger = RunLogger(run_dir, s.steps, loggers=cfg.trainer.loggers,
                           config=config_record(cfg))
        history = []

        def log(step: int, metrics: dict[str, float]) -> None:
            logger.log(step, metrics)
            history.append({"step": step, **metrics})
            append_metrics(run_dir, step, metrics)

        try:
            with placed_actor(cfg, p.model_dir, s.steps) as actor:
                loss = heldout_loss(actor, held)   # the first call waits for the ranks' build
                progress.say(f"trainer ranks ready; training {s.steps} steps on "
                             f"{len(p.train)} examples")
                log(0, {"sft/heldout_loss": loss})
                data = batches(p.train, s.batch_size, s.seed)
                for step in range(1, s.steps + 1):
                    trained = actor.train(collate_examples(next(data), p.pad_id))
                    metrics = {name: trained[key] for key, name in _METRICS.items()}
                    if step == s.steps or (s.eval_every and step % s.eval_every == 0):
                        metrics["sft/heldout_loss"] = heldout_loss(actor, held)
                    log(step, metrics)
                checkpoint = actor.save_checkpoint(str(run_dir / "checkpoints" / "sft"),
                                                   s.steps)
        finally:
            logger.close()
        progress.say(f"writing the Hugging Face model to {output_dir(cfg)}")
        megatron_to_hf(checkpoint, output_dir(cfg))
    return history


def main(argv: list[str] | None = None) -> int:
    """``ragen-mega sft CONFIG.yaml [key=value ...]``"""
    import argparse

    parser = argparse.ArgumentParser(prog="ragen-mega sft", description=main.__doc__)
    parser.add_argument("config", help="YAML config file: its env, agent, model and actor "
                                       "sections, and sft (see examples/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.steps=40")
    args = parser.parse_args(argv)
    progress.restart_clock()
    try:  # bad config or data fails before any process starts
        prepared = prepare(preflight(load_run_config(args.config, args.overrides)))
    except (ConfigError, FileNotFoundError, ValueError) as e:
        kind = "config error: " if isinstance(e, ConfigError) else ""
        print(f"ragen-mega sft: {kind}{e}", file=sys.stderr)
        return 2
    try:
        history = run(prepared)
    except RunDirInUse as e:
        print(f"ragen-mega sft: {e}", file=sys.stderr)
        return 2
    print(f"ragen-mega sft: held-out loss {history[0]['sft/heldout_loss']:.4f} -> "
          f"{history[-1]['sft/heldout_loss']:.4f}; model written to {output_dir(prepared.cfg)}")
    return 0
