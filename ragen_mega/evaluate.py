"""``ragen-mega eval CONFIG [key=value ...] --checkpoint PATH [--out FILE.json]``.

Plays the config's held-out evaluation (``env.val_*`` or ``env.mix`` entries, ``env.val_groups``
seeds from ``env.val_seed``, ``env.val_group_size`` episodes each, ``rollout.val_temperature``)
with the weights at ``PATH`` on SGLang engines, no trainer, through the training loop's own
evaluation (:meth:`RolloutManager.episodes` with ``evaluate=True``, :func:`summarize`), so the
numbers are those a run logs under ``val/``. Prints one row per env tag; ``--out`` writes JSON:
``success``, ``valid_action_rate``, ``episodes``, ``mean_turns``, ``response_length``, ``pass@k``
where k > 1, ``progression`` (BALROG's metric, for the envs that report it), ``references``
(:mod:`ragen_mega.envs.references` lines on the same seeds and budget: ``random_valid``,
``example_copy``, ``best_fixed``, ``optimal``, those that apply; absent when an env has none),
and ``per_tag`` (tag -> the same keys).

``PATH`` is ``smollm2``, a Hugging Face model directory or Hub id (as ``model.path`` takes
them), a run directory (its newest complete step) or one step's actor checkpoint
(``.../checkpoints/actor/step_N``, converted to a temporary Hugging Face directory).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

from ragen_mega.config import RunConfig, load_run_config
from ragen_mega.preflight import preflight
from ragen_mega import checkpoints
from ragen_mega.agent.prompt import example_answer
from ragen_mega.envs import registry
from ragen_mega.envs.references import REFERENCE_KEYS, reference_lines
from ragen_mega.rollout.seeding import mix_specs, val_parts
from ragen_mega.rollout.metrics import summarize

#: the run directory's file of its held-out reference lines (written by ``ragen-mega train``)
REFERENCES_FILE = "references.json"
#: summary keys of one tag (from ``summarize``'s ``val/...`` names) -> the names printed / written
_KEYS = {"success": "success", "valid_action_rate": "valid_action_rate",
         "num_turns": "mean_turns", "response_length": "response_length"}


def run_step_checkpoint(run_dir: Path) -> Path:
    """The actor checkpoint of the step a run directory's ``checkpoints/latest_step`` names."""
    step = checkpoints.latest_complete_step(run_dir)
    if step is None:
        raise FileNotFoundError(f"{run_dir}: no complete checkpoint "
                                f"({checkpoints.checkpoint_root(run_dir) / checkpoints.LATEST} "
                                f"is missing)")
    return checkpoints.step_dir(run_dir, "actor", step)


@contextlib.contextmanager
def hf_weights(path: str):
    """Yield a Hugging Face directory holding the weights at ``path`` (see the module docstring);
    a Megatron checkpoint is exported into a temporary directory removed afterwards."""
    from ragen_mega.backends.megatron import checkpoint as ckpt
    from ragen_mega.models.prepare import PRESETS, is_hub_id, resolve_model

    p = Path(path)
    if path in PRESETS or is_hub_id(path):
        yield resolve_model(path)
        return
    if not p.is_dir():
        raise FileNotFoundError(f"--checkpoint: {path} does not exist")
    # a run dir holds the run's config.json too: look for checkpoints before an HF config
    is_run, is_step = (p / "checkpoints").is_dir(), (p / ckpt.STATE_FILE).exists()
    if (p / "config.json").is_file() and not (is_run or is_step):
        yield path
        return
    step_dir = run_step_checkpoint(p) if is_run else p
    if not (step_dir / ckpt.STATE_FILE).is_file():
        raise FileNotFoundError(f"--checkpoint: {step_dir} is not a complete checkpoint (no "
                                f"{ckpt.STATE_FILE}) nor a Hugging Face model dir (no config.json)")
    from ragen_mega.backends.megatron.convert import megatron_to_hf

    with tempfile.TemporaryDirectory(prefix="ragen_eval_") as tmp:
        yield str(megatron_to_hf(step_dir, Path(tmp) / "hf"))


def evaluate(cfg: RunConfig, checkpoint: str) -> dict:
    """The held-out evaluation of ``checkpoint`` under ``cfg``: the JSON report (module doc)."""
    with hf_weights(checkpoint) as model_dir:
        episodes = play_held_out(cfg, model_dir)
    metrics = summarize(episodes, "val")
    counts = Counter(e.samples[0].env_tag for e in episodes)
    lines, tag_lines = held_out_references(cfg)
    report = {**pick(metrics, "val"), "episodes": len(episodes), "per_tag": {
        tag: {**pick(metrics, f"val/{tag}"), "episodes": counts[tag]} for tag in sorted(counts)}}
    if lines:
        report["references"] = lines
    for tag, row in report["per_tag"].items():
        if tag in tag_lines:
            row["references"] = tag_lines[tag]
    return report


def held_out_references(cfg: RunConfig) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The reference lines of the held-out evaluation: (over all its episodes, per env tag), on
    the seeds it plays, with each env's turn limit and ``agent.max_actions_per_turn``. A tag
    whose env has no lines is absent; the overall lines (episode-weighted means) exist when
    every tag has them, with the keys all tags share."""
    specs = mix_specs(val_parts(cfg.env), group_size=cfg.env.val_group_size,
                      first_seed=cfg.env.val_seed)
    per_tag, weights = {}, {}
    for part in val_parts(cfg.env):
        seeds = [s.seed for s in specs if s.env_tag == part.tag]
        example = example_answer(cfg.agent, registry.make(part.name, **part.kwargs).valid_actions)
        lines = reference_lines(part.name, part.kwargs, seeds,
                                max_turns=part.max_turns or cfg.env.max_turns,
                                max_actions_per_turn=cfg.agent.max_actions_per_turn,
                                example_answer=example)
        if lines:
            per_tag[part.tag], weights[part.tag] = lines, len(seeds)
    if len(per_tag) < len(val_parts(cfg.env)):
        return {}, per_tag
    total = sum(weights.values())
    shared = [k for k in REFERENCE_KEYS if all(k in lines for lines in per_tag.values())]
    overall = {k: sum(lines[k] * weights[tag] for tag, lines in per_tag.items()) / total
               for k in shared}
    return overall, per_tag


def pick(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """The report's keys of one ``summarize`` prefix (pass@k kept under its own name)."""
    out = {name: metrics[f"{prefix}/{key}"] for key, name in _KEYS.items()}
    out.update({key.rsplit("/", 1)[1]: value for key, value in metrics.items()
                if key.startswith(f"{prefix}/pass@") or key == f"{prefix}/progression"})
    return out


def play_held_out(cfg: RunConfig, model_dir: str) -> list:
    """Start the config's engines (and env workers) on ``model_dir``, no trainer, and play the
    held-out episodes on them; the engines' logs go to a temporary directory, not the run's."""
    from ragen_mega.ray.run import build_run

    with tempfile.TemporaryDirectory(prefix="ragen_eval_run_") as tmp:
        cfg = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, path=model_dir),
            trainer=dataclasses.replace(cfg.trainer, run_dir=tmp, colocate=False))
        with build_run(cfg, with_trainers=False) as run:
            episodes, _ = run.rollouts.episodes(0, evaluate=True, show_progress=True)
    return episodes


def format_table(report: dict) -> str:
    """One row per env tag, then the total; the reference lines next to the success."""
    rows = [*report["per_tag"].items(), ("all", report)]
    ks = sorted({k for _, row in rows for k in row if k.startswith("pass@")})
    refs = [k for k in REFERENCE_KEYS if any(k in row.get("references", {}) for _, row in rows)]
    progression = ["progression"] if any("progression" in row for _, row in rows) else []
    cols = ["episodes", "success", *progression, *refs, *ks, "valid_action_rate", "mean_turns",
            "response_length"]
    width = max(len(t) for t, _ in rows)
    lines = [f"{'env':<{width}}  " + "  ".join(f"{c:>17}" for c in cols)]
    for tag, row in rows:
        row = {**row, **row.get("references", {})}
        cells = [f"{row[c]:>17d}" if c == "episodes" else
                 (f"{row[c]:>17.3f}" if c in row else f"{'-':>17}") for c in cols]
        lines.append(f"{tag:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``ragen-mega eval CONFIG [key=value ...] --checkpoint PATH [--out FILE.json]``"""
    import argparse

    from ragen_mega.config_tree import ConfigError

    parser = argparse.ArgumentParser(prog="ragen-mega eval", description=main.__doc__)
    parser.add_argument("config", help="the run's YAML config (its env.val_* / env.mix entries)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. env.val_groups=64")
    parser.add_argument("--checkpoint", required=True,
                        help="smollm2, an HF model dir or Hub id, a run dir or a step_N "
                             "checkpoint dir")
    parser.add_argument("--out", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    try:  # a bad config or checkpoint fails before any engine starts
        cfg = preflight(load_run_config(args.config, args.overrides))
        report = evaluate(cfg, args.checkpoint)
    except (ConfigError, FileNotFoundError, checkpoints.UnreadablePointer) as e:
        kind = "config error: " if isinstance(e, ConfigError) else ""
        print(f"ragen-mega eval: {kind}{e}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0
