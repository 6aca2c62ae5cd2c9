"""Run metrics: TensorBoard scalars, one console line per step, and echo-trap warnings.

RAGEN's "echo trap" is a collapse where a policy locks into one repetitive answer: the in-group
reward std falls toward zero (every rollout of a group scores the same), the policy's entropy
falls, and the gradient norm spikes. ``EchoTrapMonitor`` watches those three signals and warns
when a configured threshold is crossed, so a user sees a collapse coming instead of reading it
off a dead curve afterwards.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Iterator, Mapping


@dataclasses.dataclass
class EchoTrapThresholds:
    """Warn when in-group reward std or entropy falls below, or grad norm rises above, these;
    and (collapse probes) when the reasoning's retrieval of its prompt is this close to chance."""
    min_group_reward_std: float = 0.01   # filter/in_group_std below this: warn
    min_entropy: float = 0.05            # actor/entropy below this: warn
    max_grad_norm: float = 100.0         # actor/grad_norm above this: warn
    min_retrieval_above_chance: float = 0.05  # collapse probes: retrieval this near chance


class EchoTrapMonitor:
    """Checks one step's metrics against :class:`EchoTrapThresholds`; returns warning texts.

    Metric names it reads: ``filter/in_group_std`` (before the filter), ``actor/entropy``,
    ``actor/grad_norm``, ``collapse_first_turn_sample/retrieval_above_chance`` (the collapse
    probes' steps). A missing metric is not checked (e.g. no critic, no eval this step).
    """

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


def format_console_line(step: int, total: int, metrics: Mapping[str, float]) -> str:
    """``step 3/10 | succ 0.42 | rew 0.31 | ...`` with the metrics that exist this step; a
    mixed-env run adds the per-tag values in brackets (one env: they equal the total)."""
    parts = [f"step {step}/{total}"]
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


class RunLogger:
    """Writes every scalar to TensorBoard under ``log_dir`` and a short line to the console."""

    def __init__(self, log_dir: str | Path, total_steps: int,
                 thresholds: EchoTrapThresholds | None = None, stream: IO[str] | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.total_steps = total_steps
        self.monitor = EchoTrapMonitor(thresholds or EchoTrapThresholds())
        self.stream = stream or sys.stdout

    def log(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """Record ``metrics`` at ``step``; print the console line and any echo-trap warnings."""
        for name, value in metrics.items():
            self.writer.add_scalar(name, float(value), global_step=step)
        self.writer.flush()
        print(format_console_line(step, self.total_steps, metrics), file=self.stream, flush=True)
        warnings = self.monitor.check(metrics)
        for text in warnings:
            print(f"WARNING step {step}: {text}", file=self.stream, flush=True)
        return warnings

    def close(self) -> None:
        self.writer.close()
