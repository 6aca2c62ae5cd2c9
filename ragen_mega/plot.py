"""``ragen-mega plot RUN_DIR [RUN_DIR ...] --out FILE.png``: a run's first-look curves as a picture.

Reads each run's ``metrics.jsonl`` (one JSON object per training step) and draws, by step:
success and valid-action rate (training solid, held-out evaluation dashed), the in-group reward
std before and after the StarPO-S filter (the echo-trap signal), the actor's entropy and grad
norm, and each phase's time. Runs share the axes, one colour each. The success panel adds the
held-out reference lines of ``RUN_DIR/references.json`` (:mod:`ragen_mega.envs.references`) as
thin horizontal lines, once when all runs share them, else in each run's colour. Uses
matplotlib's Agg backend: no display needed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ragen_mega.evaluate import REFERENCES_FILE

#: panel title -> [(metric key, line style label)]; a key a run never logged is left out
PANELS: dict[str, list[tuple[str, str]]] = {
    "success": [("rollout/success", "train"), ("val/success", "val")],
    "valid-action rate": [("rollout/valid_action_rate", "train"),
                          ("val/valid_action_rate", "val")],
    "in-group reward std": [("filter/in_group_std", "before filter"),
                            ("filter/chosen_in_group_std", "after filter")],
    "actor entropy": [("actor/entropy", "")],
    "actor grad norm": [("actor/grad_norm", "")],
    "phase time (s)": [("time/rollout_s", "rollout"), ("time/train_s", "train"),
                       ("time/sync_s", "sync"), ("time/eval_s", "eval")],
}
_STYLES = ["-", "--", ":", "-."]
#: reference line -> its dash pattern on the success panel
_REFERENCE_STYLES = {"random_valid": (0, (1, 2)), "example_copy": (0, (4, 2)),
                     "best_fixed": (0, (6, 2, 1, 2)), "optimal": (0, (8, 2))}


def load_metrics(run_dir: str | Path) -> list[dict]:
    """The run's per-step metrics, in step order; a missing, empty or unreadable file is a clear
    error. A resumed run appends the steps after its checkpoint again: a step's last line wins
    (as in ``ragen-mega view``)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"ragen-mega plot: no metrics file {path} (is {run_dir} a run "
                                f"directory of `ragen-mega train`?)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"ragen-mega plot: {path} line {n} is not JSON: {e}") from None
    if not rows:
        raise ValueError(f"ragen-mega plot: {path} has no steps yet")
    by_step = {row.get("step"): row for row in rows}
    return [by_step[step] for step in sorted(by_step, key=lambda s: (s is None, s))]


def load_references(run_dir: str | Path) -> dict[str, float]:
    """The run's overall held-out reference lines ({} when it has none)."""
    path = Path(run_dir) / REFERENCES_FILE
    if not path.is_file():
        return {}
    try:
        return dict(json.loads(path.read_text()).get("references", {}))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"ragen-mega plot: {path} is not a references file: {e}") from None


def draw_references(ax, runs: list[tuple[str, dict[str, float]]], colors: list[str]) -> None:
    """Horizontal reference lines: once, grey, when every run has the same; else per run."""
    distinct = {tuple(sorted(lines.items())) for _, lines in runs if lines}
    shared = len(distinct) == 1 and all(lines for _, lines in runs)
    for r, (name, lines) in enumerate(runs[:1] if shared else runs):
        for key, value in lines.items():
            ax.axhline(value, linestyle=_REFERENCE_STYLES.get(key, ":"), linewidth=1,
                       color="grey" if shared else colors[r % len(colors)],
                       label=key if shared else f"{name} {key}")


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the steps that logged it."""
    pairs = [(int(r["step"]), float(r[key])) for r in rows if key in r]
    return [s for s, _ in pairs], [v for _, v in pairs]


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None):
    """Draw the panels for every run (overlaid) and save to ``out`` if given; returns the Figure
    (its axes' lines carry the plotted data, labelled ``<run> <series>``, reference lines
    ``<key>`` or ``<run> <key>``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(d).name or str(d), load_metrics(d)) for d in run_dirs]
    references = [(name, load_references(d)) for (name, _), d in zip(runs, run_dirs)]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys) in zip(axes.flat, PANELS.items()):
        for r, (name, rows) in enumerate(runs):
            for k, (key, label) in enumerate(keys):
                steps, values = series(rows, key)
                if steps:
                    ax.plot(steps, values, _STYLES[k % len(_STYLES)], marker=".",
                            color=colors[r % len(colors)], label=f"{name} {label}".strip())
        if title == "success":
            draw_references(ax, references, colors)
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize="small")
    fig.tight_layout()
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
    return fig


def main(argv: list[str] | None = None) -> int:
    """``ragen-mega plot RUN_DIR [RUN_DIR ...] --out FILE.png``"""
    import argparse

    parser = argparse.ArgumentParser(prog="ragen-mega plot", description=main.__doc__)
    parser.add_argument("run_dirs", nargs="+", help="run directories (trainer.run_dir)")
    parser.add_argument("--out", required=True, help="PNG file to write")
    args = parser.parse_args(argv)
    try:
        plot_runs(args.run_dirs, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    print(args.out)
    return 0
