"""A run's checkpoints: save after a step, find the newest complete one, resume from it.

Layout under ``RUN_DIR/checkpoints``::

    actor/step_N/       the actor's Megatron checkpoint after the loop's step N
    critic/step_N/      the critic's (runs with a critic)
    latest_step         "N": written last, so step N is complete (actor and critic) once it names N

A save killed before the pointer (a SIGKILL, a preempted job's second signal) leaves
``step_N`` directories newer than it: resuming discards them, as the resumed run writes those
steps again.

Each checkpoint's extra state holds the step, the data cursor (:func:`data_cursor`) and the
driver's RNG states. Env and (``rollout.seeded``) sampling seeds are functions of the step, so a
resumed run replays the uninterrupted one (tests/test_resume_equivalence.py). A streamed run
(``rollout.mode: turns``) also saves its env streams (``rollout/streams.py``: each stream's
episode index and current episode's responses), and ``async_mode: one_step_off`` the next
step's rollout, already played (``PlayedStep.state_dict``).

The extra state holds plain values only (ints, floats, str, lists, tuples, dicts, tensors), read
with ``torch.load(weights_only=True)``, which executes nothing; no class is pickled, so renaming
one leaves old checkpoints readable.
"""
from __future__ import annotations

import os
import random
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ragen_mega.rollout.manager import PlayedStep

if TYPE_CHECKING:
    from ragen_mega.config import RunConfig
    from ragen_mega.ray.trainer_group import TrainerGroup

LATEST = "latest_step"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | Path, role: str, step: int) -> Path:
    """``RUN_DIR/checkpoints/<role>/step_<step>``: where the trainer's ``save_checkpoint`` puts
    ``role``'s checkpoint of the loop's ``step``."""
    return checkpoint_root(run_dir) / role / f"step_{step}"


class UnreadablePointer(ValueError):
    """``latest_step`` exists but names no step (a hand edit, a copy cut short, another tool's
    file); the message names the file and what it holds."""


def latest_complete_step(run_dir: str | Path) -> int | None:
    """The newest step whose actor (and critic) checkpoints are all written, or None without a
    ``latest_step``. The one reader of the pointer; raises :class:`UnreadablePointer` when it
    holds anything but a step number."""
    pointer = checkpoint_root(run_dir) / LATEST
    if not pointer.exists():
        return None
    try:
        text = pointer.read_bytes().decode()
    except (OSError, UnicodeDecodeError) as e:
        raise UnreadablePointer(f"{pointer} cannot be read as a step number "
                                f"({type(e).__name__}: {e})") from e
    if not (text.strip().isascii() and text.strip().isdigit()):
        shown = repr(text) if len(text) <= 80 else f"{text[:80]!r}... ({len(text)} characters)"
        raise UnreadablePointer(f"{pointer} holds {shown}, not a step number")
    return int(text)


def discard_incomplete(run_dir: str | Path) -> None:
    """Remove the step directories newer than ``latest_step`` (a save that never completed). An
    unreadable pointer says nothing about which saves completed: nothing is removed
    (:func:`newest_intact_step` then verifies every step instead)."""
    try:
        newest = latest_complete_step(run_dir) or 0
    except UnreadablePointer:
        return
    root = checkpoint_root(run_dir)
    stale = [d for role in ("actor", "critic") for d in sorted((root / role).glob("step_*"))
             if d.name[5:].isdigit() and int(d.name[5:]) > newest]
    for d in stale:
        warnings.warn(f"trainer.resume: discarding {d}: its step never completed "
                      f"(latest_step is {newest})")
        shutil.rmtree(d)


def newest_intact_step(run_dir: str | Path, with_critic: bool) -> int | None:
    """The newest complete step whose files are all whole (``verify_checkpoint``), or None.

    A newer step with a truncated or missing file is refused with a warning naming the file and
    moved aside to ``corrupt-step_N`` (kept for inspection), and ``latest_step`` is set back to
    the step resumed from. A whole step whose state pickles classes (``LegacyCheckpoint``) is not
    corrupt: its error ends the resume and nothing is moved aside.

    When ``latest_step`` names no step, a warning says so and every step directory is a
    candidate: complete then means the actor's (and critic's) directories verify, which a save
    in progress or killed never does; the pointer is rewritten to the step found."""
    from ragen_mega.backends.megatron.checkpoint import CorruptCheckpoint, verify_checkpoint

    root = checkpoint_root(run_dir)
    try:
        newest = latest_complete_step(run_dir)
    except UnreadablePointer as e:
        warnings.warn(f"trainer.resume: {e}; resuming from the newest step whose "
                      f"{'actor and critic checkpoints' if with_critic else 'actor checkpoint'} "
                      f"verify instead")
        newest, pointed = None, str(e)
    else:
        if newest is None:
            return None
        pointed = f"latest_step names {newest}"
    roles = ("actor", "critic") if with_critic else ("actor",)
    saved = sorted((s for s in _saved_steps(root) if newest is None or s <= newest),
                   reverse=True)
    for step in saved:
        try:
            for role in roles:
                verify_checkpoint(step_dir(run_dir, role, step))
        except (CorruptCheckpoint, FileNotFoundError) as e:
            warnings.warn(f"trainer.resume: refusing step {step}: {e}; falling back to the "
                          f"previous checkpoint")
            for role in ("actor", "critic"):
                bad = step_dir(run_dir, role, step)
                aside = bad.with_name(f"corrupt-{bad.name}")
                if bad.exists():
                    shutil.rmtree(aside, ignore_errors=True)  # an older refusal of this step
                    os.replace(bad, aside)
            continue
        if step != newest:
            _write_latest(root, step)
        return step
    refused = "every step was refused, see the warnings" if saved else "no step_N directory"
    raise RuntimeError(f"trainer.resume=auto: no intact checkpoint under {root} ({pointed}; "
                       f"{refused}); set trainer.resume=never to start afresh")


def _saved_steps(root: Path) -> set[int]:
    """The steps with a ``step_N`` directory of either role under ``root``: a critic's without
    the actor's is a candidate too, so that it is refused (and moved aside) rather than left
    where the resumed run's save of that step would find it."""
    return {int(d.name[5:]) for role in ("actor", "critic") for d in (root / role).glob("step_*")
            if d.name[5:].isdigit()}


def _write_latest(root: Path, step: int) -> None:
    """Point ``latest_step`` at ``step`` (one atomic rename)."""
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(str(step))
    os.replace(tmp, root / LATEST)


def find_resume_step(cfg: RunConfig, with_critic: bool | None = None) -> int | None:
    """The step ``trainer.resume=auto`` continues after (None: no checkpoint), once the saves
    that never completed are discarded and the corrupt ones moved aside; repeating it finds
    the same step and changes nothing more. ``with_critic`` defaults to ``critic.enable``."""
    run_dir = cfg.trainer.run_dir
    discard_incomplete(run_dir)
    return newest_intact_step(run_dir, cfg.critic.enable if with_critic is None else with_critic)


def has_checkpoints(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds any saved step (complete or not) or a ``latest_step``."""
    root = checkpoint_root(run_dir)
    return (root / LATEST).exists() or bool(_saved_steps(root))


def prune(run_dir: str | Path, keep: int) -> list[int]:
    """Remove all but the newest ``keep`` complete steps (``trainer.keep_checkpoints``); returns
    the steps removed. Only steps up to the one ``latest_step`` names are candidates, so a save
    under way (newer than the pointer) is never touched. The critic goes before the actor, so a
    removal cut short leaves no lone actor that a resume could take as complete."""
    newest = latest_complete_step(run_dir)
    if newest is None:
        return []
    root = checkpoint_root(run_dir)
    complete = sorted(s for s in _saved_steps(root) if s <= newest)
    removed = complete[:-keep] if len(complete) > keep else []
    for step in removed:
        for role in ("critic", "actor"):
            shutil.rmtree(step_dir(run_dir, role, step), ignore_errors=True)
    return removed


def rng_states() -> dict:
    """The driver's Python, NumPy and torch RNG states. The loop draws from none of them, but a
    user's env or hook may, so they are checkpointed.

    Plain values only (``weights_only`` loading refuses NumPy arrays): Python's state is a tuple
    of ints, torch's a uint8 tensor, NumPy's legacy ``get_state()`` tuple a dict with its 624
    MT19937 keys as an int64 tensor."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {"python": random.getstate(),
            "numpy": {"bit_generator": str(name),
                      "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached_gaussian)},
            "torch": torch.get_rng_state()}


def set_rng_states(states: dict) -> None:
    """Restore :func:`rng_states`: every generator draws next what it drew after the save."""
    random.setstate(states["python"])
    n = states["numpy"]
    np.random.set_state((n["bit_generator"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(states["torch"])


def data_cursor(cfg: RunConfig) -> dict:
    """What, besides the step, decides the episodes and samples of a step (env seeds and
    sampling seeds are functions of these and the step)."""
    return {"env.seed": cfg.env.seed, "trainer.seed": cfg.trainer.seed,
            "rollout.seeded": cfg.rollout.seeded, "rollout.mode": cfg.rollout.mode,
            "rollout.turns_per_step": cfg.rollout.turns_per_step}


def save(cfg: RunConfig, step: int, actor: TrainerGroup, critic: TrainerGroup | None,
         streams: dict | None = None, pending=None) -> None:
    """Save actor (and critic) checkpoints for ``step``, then the pointer that makes it complete,
    then prune to ``trainer.keep_checkpoints``. The extra state also keeps ``streams`` (turns
    mode, ``EnvStreams.state_dict``) and ``pending``, step ``step + 1``'s rollout already played
    (``async_mode: one_step_off``, a ``PlayedStep``, kept as its ``state_dict``)."""
    root = checkpoint_root(cfg.trainer.run_dir)
    extra = {"step": step, "data_cursor": data_cursor(cfg), "rng": rng_states(),
             "streams": streams,
             "pending_rollout": None if pending is None else pending.state_dict()}
    actor.save_checkpoint(str(root / "actor"), step, extra)
    if critic is not None:
        critic.save_checkpoint(str(root / "critic"), step, extra)
    _write_latest(root, step)
    if cfg.trainer.keep_checkpoints is not None:
        prune(cfg.trainer.run_dir, cfg.trainer.keep_checkpoints)


def resume(cfg: RunConfig, actor: TrainerGroup, critic: TrainerGroup | None
           ) -> tuple[int, dict | None, PlayedStep | None]:
    """Load the checkpoints and RNG states to resume from; return the step to continue after
    (0 = fresh start), the env streams' saved state (None: fresh start or episodes mode) and the
    next step's rollout played before the save (a ``PlayedStep`` logging further faults to
    ``RUN_DIR/faults.jsonl``; None unless ``async_mode: one_step_off``).

    ``trainer.resume``: ``auto`` (the newest complete step, if any; ``force`` alike, its config
    check is ``run_intent``'s), ``never``, or a directory holding ``actor/`` (and ``critic/``)."""
    mode = cfg.trainer.resume
    if mode == "never":
        return 0, None, None
    if mode in ("auto", "force"):
        step = find_resume_step(cfg, critic is not None)
        if step is None:
            return 0, None, None
        actor_dir, critic_dir = (step_dir(cfg.trainer.run_dir, role, step)
                                 for role in ("actor", "critic"))
    else:
        actor_dir, critic_dir = Path(mode) / "actor", Path(mode) / "critic"
    extra = actor.load_checkpoint(str(actor_dir))
    if critic is not None:
        critic.load_checkpoint(str(critic_dir))
    step = int(extra["step"])
    set_rng_states(extra["rng"])
    saved = extra["data_cursor"]
    changed = [f"{k}={saved[k]!r} (now {v!r})" for k, v in data_cursor(cfg).items()
               if k in saved and saved[k] != v]
    if changed:
        warnings.warn(f"trainer.resume: step {step}'s checkpoint was written with "
                      f"{', '.join(changed)}; the resumed steps will not replay the "
                      f"uninterrupted run's")
    pending = extra.get("pending_rollout")
    if pending is not None and cfg.trainer.async_mode != "one_step_off":
        warnings.warn(f"trainer.resume: step {step}'s checkpoint holds step {step + 1}'s "
                      f"rollout, played during step {step} (trainer.async_mode=one_step_off); "
                      f"without it now, step {step + 1} is played again")
        pending = None
    elif pending is not None:
        pending = PlayedStep.from_state_dict(pending, Path(cfg.trainer.run_dir) / "faults.jsonl")
    return step, extra.get("streams"), pending
