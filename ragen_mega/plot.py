"""``ragen-mega plot RUN_DIR [RUN_DIR ...] --out FILE.png``: a run's first-look curves as a picture.

Reads each run's own ``metrics.jsonl`` (one JSON object per training step, written by the loop)
and draws, by step: success and valid-action rate (training rollouts solid, held-out evaluation
dashed where the run evaluated), the in-group reward std before and after the StarPO-S filter
(the echo-trap signal), the actor's entropy and grad norm, and the time of each phase. Several
runs share the axes, one colour per run, so a comparison is one picture. matplotlib's Agg
backend: no display needed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

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


def load_metrics(run_dir: str | Path) -> list[dict]:
    """The run's per-step metrics; a missing, empty or unreadable file is a clear error."""
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
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the steps that logged it."""
    pairs = [(int(r["step"]), float(r[key])) for r in rows if key in r]
    return [s for s, _ in pairs], [v for _, v in pairs]


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None):
    """Draw the panels for every run (overlaid) and save to ``out`` if given; returns the Figure
    (its axes' lines carry the plotted data, labelled ``<run> <series>``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(d).name or str(d), load_metrics(d)) for d in run_dirs]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys) in zip(axes.flat, PANELS.items()):
        for r, (name, rows) in enumerate(runs):
            for k, (key, label) in enumerate(keys):
                steps, values = series(rows, key)
                if steps:
                    ax.plot(steps, values, _STYLES[k % len(_STYLES)], marker=".",
                            color=colors[r % len(colors)], label=f"{name} {label}".strip())
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
