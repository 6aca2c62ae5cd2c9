"""What a start of ``ragen-mega train`` does with its run directory: said before anything starts,
refused when it would not be what the config says.

Every example fixes ``trainer.run_dir``, and ``trainer.resume`` defaults to ``auto``, so running a
command twice continues (or finds finished) the run already there. :func:`start_plan` decides
which happens, and its ``message`` says so in one line: a new run; resuming from step N of M
(with the keys changed since the last start); or complete at step M (nothing to do, and how to
go on).

A resume compares the config key by key with the one the run last started with
(``RUN_DIR/config.json``, written at every start). Keys in :data:`MAY_CHANGE` (length, cadences,
loggers, where Ray runs, how many engines) may change and are listed; any other changed key
changes what the run means (model, env, agent, algorithm, filter, optimizer, sampling, seeds,
layout), and the start ends with :class:`ConfigChanged`, naming each key old -> new, before any
process starts. ``trainer.resume=force`` resumes anyway. Every accepted change is appended to
``RUN_DIR/config_changes.jsonl`` with the step it applies from and whether it was forced.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

from ragen_mega import checkpoints
from ragen_mega.config_tree import ConfigError

#: the config file a start writes into the run directory and the next start compares with
CONFIG_FILE = "config.json"
#: one JSON line per resume that changed the config: step, time, forced, {key: [old, new]}
CHANGES_FILE = "config_changes.jsonl"

#: keys that may differ on resume: how long the run goes, how often it saves, evaluates and
#: probes, what it writes and where, and the placement of rollouts, none of which changes the
#: episodes a step plays or how it trains on them. A dotted prefix ending in "." covers a section.
MAY_CHANGE = (
    "trainer.total_steps", "trainer.save_every", "trainer.eval_every",
    "trainer.keep_checkpoints", "trainer.loggers", "trainer.ray_address", "trainer.resume",
    "trainer.run_dir", "trainer.save_trajectories", "trainer.trajectory_samples",
    "trainer.save_rollouts", "trainer.check_weight_sync", "trainer.sync_bucket_mb",
    "trainer.collapse_every", "trainer.collapse_samples", "trainer.max_skipped_updates_in_row",
    "rollout.num_engines", "rollout.env_workers", "rollout.env_steps_in_thread",
    "rollout.batch_requests",
    "rollout.mem_fraction", "rollout.max_engine_restarts_per_step",
    "rollout.max_env_failure_rate", "env.remote", "env.remote_timeout_s", "echo_trap.", "sft.",
)


class ConfigChanged(ConfigError):
    """A resume whose config differs from the run's in keys that change what it means; the
    message names each key, old -> new, and the ways on."""


@dataclasses.dataclass(frozen=True)
class StartPlan:
    """What this start does: ``resume_step`` is the checkpoint continued from (None: a new run,
    or ``trainer.resume`` names a checkpoint directory), ``changes`` the keys that differ from
    the run's last start ({key: (old, new)}), ``message`` the line printed at the start."""
    run_dir: Path
    resume_step: int | None
    total_steps: int
    changes: dict[str, tuple[Any, Any]]
    forced: bool
    message: str

    @property
    def complete(self) -> bool:
        """The run has reached ``trainer.total_steps`` already: nothing to train."""
        return self.resume_step is not None and self.resume_step >= self.total_steps


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_record(cfg) -> dict:
    """The run config as ``RUN_DIR/config.json`` holds it (tuples as lists, JSON's values)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def may_change(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in MAY_CHANGE)


def config_changes(saved: dict, now: dict) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (saved value, current value)} for every key both configs hold with
    different values; a key only one side holds (another code version's config) is skipped."""
    old, new = flatten(saved), flatten(now)
    return {k: (old[k], new[k]) for k in sorted(old.keys() & new.keys()) if old[k] != new[k]}


def start_plan(cfg) -> StartPlan:
    """Decide what this start does with ``trainer.run_dir`` (see the module docstring); raises
    :class:`ConfigChanged` for a resume whose config changed in a key not in :data:`MAY_CHANGE`
    (unless ``trainer.resume=force``). Finding the step verifies the checkpoint files as the
    resume itself does (``checkpoints.find_resume_step``), so the step named is the one loaded."""
    t = cfg.trainer
    run_dir, mode = Path(t.run_dir), t.resume
    if mode not in ("auto", "force", "never"):
        return StartPlan(run_dir, None, t.total_steps, {}, False,
                         f"starting {run_dir} from the checkpoint in {mode} (trainer.resume)")
    newest = None if mode == "never" else checkpoints.find_resume_step(cfg)
    if newest is None:
        return StartPlan(run_dir, None, t.total_steps, {}, False, _new_run_line(cfg, run_dir))
    saved_file = run_dir / CONFIG_FILE
    changes = (config_changes(json.loads(saved_file.read_text()), config_record(cfg))
               if saved_file.is_file() else {})
    meaning = {k: v for k, v in changes.items() if not may_change(k)}
    forced = bool(meaning) and mode == "force"
    if meaning and not forced:
        keys = "\n".join(f"  {k}: {json.dumps(a)} -> {json.dumps(b)}"
                         for k, (a, b) in meaning.items())
        raise ConfigChanged(
            f"{run_dir} holds a run at step {newest} whose config differs in keys that change "
            f"what it trains:\n{keys}\nStart a new run (another trainer.run_dir), put these keys "
            f"back, or resume anyway with trainer.resume=force (recorded in "
            f"{run_dir / CHANGES_FILE})")
    if newest >= t.total_steps:
        message = (f"{run_dir} is complete at step {newest} (trainer.total_steps={t.total_steps})"
                   f": nothing to do. To train on, raise trainer.total_steps; for a new run, set "
                   f"another trainer.run_dir")
    else:
        message = f"resuming {run_dir} from step {newest} of {t.total_steps}"
        if not saved_file.is_file():
            message += f" (no {CONFIG_FILE} there to compare the config with)"
    if changes:
        listed = ", ".join(f"{k} {json.dumps(a)} -> {json.dumps(b)}"
                           for k, (a, b) in changes.items())
        message += (f"; {'FORCED (trainer.resume=force), ' if forced else ''}changed since its "
                    f"last start: {listed}")
    return StartPlan(run_dir, newest, t.total_steps, changes, forced, message)


def _new_run_line(cfg, run_dir: Path) -> str:
    line = f"new run in {run_dir}"
    if cfg.trainer.resume == "never" and checkpoints.has_checkpoints(run_dir):
        line += " (trainer.resume=never: its checkpoints are written over)"
    elif (run_dir / "metrics.jsonl").is_file():
        line += " (an earlier start there saved no checkpoint: started over)"
    return line


def record_start(cfg, plan: StartPlan) -> None:
    """Write this start's config as the run's (``config.json``) and, when a resume changed it,
    one line of ``config_changes.jsonl``; called once the start goes ahead."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    if plan.changes:
        entry = {"step": plan.resume_step, "forced": plan.forced,
                 "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 "changes": {k: list(v) for k, v in plan.changes.items()}}
        with open(plan.run_dir / CHANGES_FILE, "a") as f:
            f.write(json.dumps(entry) + "\n")
    (plan.run_dir / CONFIG_FILE).write_text(json.dumps(config_record(cfg), indent=2))
