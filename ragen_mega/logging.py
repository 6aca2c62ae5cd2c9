"""Run metrics: each step's scalars to the trackers (TensorBoard, wandb, MLflow), one console
line per step, and echo-trap warnings.

RAGEN's "echo trap" is a collapse where a policy locks into one repetitive answer: the in-group
reward std falls toward zero (every rollout of a group scores the same), the policy's entropy
falls, and the gradient norm spikes. ``EchoTrapMonitor`` warns when one of these crosses its
threshold, so a user sees a collapse coming.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Iterator, Mapping, Sequence

from ragen_mega.config_tree import setting
from ragen_mega.progress import eta_text


@dataclasses.dataclass
class EchoTrapThresholds:
    """Warn when in-group reward std or entropy falls below, or grad norm rises above, these;
    and (collapse probes) when the reasoning's retrieval of its prompt is this close to chance."""
    min_group_reward_std: float = setting(0.01, help=(
        "warn when a step's in-group reward std (filter/in_group_std) falls below this"))
    min_entropy: float = setting(0.05, help=(
        "warn when the policy's entropy (actor/entropy) falls below this"))
    max_grad_norm: float = setting(100.0, help=(
        "warn when the actor's gradient norm (actor/grad_norm) rises above this"))
    min_retrieval_above_chance: float = setting(0.05, help=(
        "collapse probes (trainer.collapse_every): warn when a reasoning picks out its own prompt "
        "no more often than this above chance"))


class EchoTrapMonitor:
    """Checks one step's metrics against :class:`EchoTrapThresholds`; returns warning texts.

    Reads ``filter/in_group_std`` (before the filter), ``actor/entropy``, ``actor/grad_norm`` and
    ``collapse_first_turn_sample/retrieval_above_chance`` (collapse-probe steps); a missing
    metric is not checked."""

    _CHECKS = (
        ("filter/in_group_std", "min_group_reward_std", "below",
         "rollouts within a group all score alike: the policy may be collapsing (echo trap)"),
        ("actor/entropy", "min_entropy", "below",
         "policy entropy is very low: answers are becoming deterministic (echo trap)"),
        ("actor/grad_norm", "max_grad_norm", "above",
         "gradient norm spike: updates may be unstable"),
        ("collapse_first_turn_sample/retrieval_above_chance", "min_retrieval_above_chance",
         "below", "the reasoning barely tells its own prompt from the others': it may no longer "
                  "depend on the input (template collapse, RAGEN-2)"),
    )

    def __init__(self, thresholds: EchoTrapThresholds):
        self.thresholds = thresholds

    def check(self, metrics: Mapping[str, float]) -> list[str]:
        warnings = []
        for name, field, side, why in self._CHECKS:
            if name not in metrics:
                continue
            value, limit = float(metrics[name]), getattr(self.thresholds, field)
            crossed = value < limit if side == "below" else value > limit
            if crossed or not math.isfinite(value):
                warnings.append(f"{name}={value:.4g} is {side} {field}={limit:g}: {why}")
        return warnings


_CONSOLE_KEYS = (
    ("rollout/success", "succ"), ("rollout/reward_mean", "rew"),
    ("rollout/valid_action_rate", "valid"), ("actor/pg_loss", "pg"),
    ("actor/entropy", "ent"), ("actor/grad_norm", "gnorm"), ("critic/vf_loss", "vf"),
    ("val/success", "val succ"), ("val/valid_action_rate", "val valid"),
    ("sft/loss", "loss"), ("sft/heldout_loss", "held-out loss"), ("time/step_s", "s/step"),
)


#: shown per env tag too when a run mixes envs: ``succ 0.4 (sokoban 0.3, lake 0.5)``
_PER_TAG_KEYS = ("rollout/success", "val/success")


def _per_tag(metrics: Mapping[str, float], name: str) -> dict[str, float]:
    """``{tag: value}`` of the per-env-tag versions of metric ``name`` (``rollout/<tag>/success``
    for ``rollout/success``), in the order they were logged."""
    section, _, key = name.partition("/")
    out = {}
    for full, value in metrics.items():
        parts = full.split("/")
        if len(parts) == 3 and parts[0] == section and parts[2] == key:
            out[parts[1]] = float(value)
    return out


def format_console_line(step: int, total: int, metrics: Mapping[str, float],
                        eta_s: float | None = None) -> str:
    """``step 3/10 | eta 4m05s | succ 0.42 | rew 0.31 | ...`` with the metrics that exist this
    step; a mixed-env run adds the per-tag values in brackets (one env: they equal the total)."""
    parts = [f"step {step}/{total}"]
    if eta_s is not None:
        parts.append(f"eta {eta_text(eta_s)}")
    for name, short in _CONSOLE_KEYS:
        if name in metrics:
            part = f"{short} {float(metrics[name]):.4g}"
            tags = _per_tag(metrics, name) if name in _PER_TAG_KEYS else {}
            if len(tags) > 1:
                part += " (" + ", ".join(f"{t} {v:.3g}" for t, v in tags.items()) + ")"
            parts.append(part)
    return " | ".join(parts)


@contextlib.contextmanager
def timed(metrics: dict[str, float], key: str) -> Iterator[None]:
    """Add the block's wall-clock seconds to ``metrics[key]`` (a phase of the step's
    ``time/*`` breakdown; a phase run twice in a step adds up)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start


def append_metrics(run_dir: str | Path, step: int, metrics: Mapping[str, float]) -> None:
    """One line of ``RUN_DIR/metrics.jsonl`` (what ``ragen-mega plot`` reads)."""
    with open(Path(run_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")


class StepPace:
    """The time a run has left, from the pace of the steps logged since this process began:
    the wall time from the first logged training step to the latest (evaluations and saves
    included) per step, or for the first one its own ``time/step_s``."""

    def __init__(self):
        self.first: tuple[int, float] | None = None

    def eta_s(self, step: int, total: int, metrics: Mapping[str, float],
              now: float | None = None) -> float | None:
        now = time.perf_counter() if now is None else now
        if step < 1:   # the step-0 evaluation: no training step yet
            return None
        if self.first is None or step <= self.first[0]:
            self.first = (step, now)
            per_step = metrics.get("time/step_s")
        else:
            per_step = (now - self.first[1]) / (step - self.first[0])
        if per_step is None or step >= total:   # the last step: nothing left to estimate
            return None
        return float(per_step) * (total - step)


class RunLogger:
    """Writes every scalar to each of ``loggers`` (``trainer.loggers``: TensorBoard, wandb,
    MLflow; :mod:`ragen_mega.trackers`) and a short line to the console. ``config`` (the
    resolved run config) goes to the trackers that record one; ``resume`` continues the
    trackers' runs of ``run_dir`` (a resumed training run) instead of starting new ones."""

    def __init__(self, run_dir: str | Path, total_steps: int,
                 thresholds: EchoTrapThresholds | None = None, stream: IO[str] | None = None,
                 loggers: Sequence[str] = ("tensorboard",), config: dict | None = None,
                 resume: bool = False):
        from ragen_mega.trackers import open_trackers

        self.total_steps = total_steps
        self.monitor = EchoTrapMonitor(thresholds or EchoTrapThresholds())
        self.stream = stream or sys.stdout
        self.pace = StepPace()
        self.trackers = open_trackers(list(loggers), run_dir, config or {}, resume, self.stream)

    def log(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """Record ``metrics`` at ``step``; print the console line and any echo-trap warnings."""
        for tracker in self.trackers:
            tracker.log(step, metrics)
        eta = self.pace.eta_s(step, self.total_steps, metrics)
        print(format_console_line(step, self.total_steps, metrics, eta), file=self.stream,
              flush=True)
        warnings = self.monitor.check(metrics)
        for text in warnings:
            print(f"WARNING step {step}: {text}", file=self.stream, flush=True)
        return warnings

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
