"""``ragen-mega sweep SWEEP.yaml --report``: each variant's held-out results across its seeds,
as interval estimates (Agarwal et al. 2021, "Deep Reinforcement Learning at the Edge of the
Statistical Precipice", NeurIPS; their library ``rliable``).

Per run (from its ``metrics.jsonl``, ``references.json`` and config), on the held-out curve
(``report.metric``, ``val/success`` by default): the value at the last evaluation (``end``) and
at each of ``report.at_steps``; the area under the curve over its steps, divided by them (the
curve's mean height, trapezoids between evaluations); the first evaluation step at or above each
of ``report.lines`` (a share of a reference line; a run that never gets there counts as its
``trainer.total_steps``, and the cell says how many got there); whether and when it collapsed
(:mod:`ragen_mega.collapse`).

Per variant, each of these across seeds is the **IQM** (interquartile mean: the mean of the
middle half, 25% cut from each end, as ``scipy.stats.trim_mean(x, 0.25)``; with fewer than 4
seeds nothing is cut, it is the mean) with a **95% stratified bootstrap interval** (resample
the seeds with replacement, ``report.reps`` times, percentile interval); the share of seeds
that collapsed is a mean (with the same interval) and the collapse step a median over the
collapsed seeds. A sweep runs one task (its base config), so the stratified bootstrap is the
bootstrap over that task's seeds. For each ``report.pairs`` [X, Y], the **probability of
improvement** P(X > Y): the chance that a seed of X ends above a seed of Y (ties count half;
the Mann-Whitney U over the pairs), with its interval from resampling both variants' seeds.
These are rliable 1.2's ``aggregate_iqm``, ``StratifiedBootstrap`` (percentile method) and
``probability_of_improvement``, written in numpy here: rliable's bootstrap needs the ``arch``
package, whose versions rliable allows fail to import with this stack's pandas.

Output: ``SWEEP_DIR/report.md`` (printed too) and ``SWEEP_DIR/report.png``, each variant's IQM
curve with its interval band against the runs' reference lines.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ragen_mega import collapse
from ragen_mega.plot import draw_references, load_metrics, load_references, series
from ragen_mega.sweep import reached_end

REPORT_FILE = "report.md"
PLOT_FILE = "report.png"
CONFIDENCE = 0.95


# ------------------------------------------------------------------------------- estimators
def iqm(values) -> np.ndarray:
    """The interquartile mean over the last axis: the mean after cutting ``int(0.25 n)`` values
    from each end of the sorted values (``scipy.stats.trim_mean(values, 0.25)``, rliable's
    ``aggregate_iqm``)."""
    x = np.sort(np.asarray(values, dtype=float), axis=-1)
    n = x.shape[-1]
    cut = int(0.25 * n)
    return x[..., cut:n - cut].mean(axis=-1)


def mean(values) -> np.ndarray:
    return np.asarray(values, dtype=float).mean(axis=-1)


def probability_of_improvement(x, y) -> np.ndarray:
    """P(X > Y) for a seed of X and one of Y, ties counting half: the Mann-Whitney U of X
    over Y divided by ``len(x) * len(y)`` (rliable's ``probability_of_improvement``); over
    the last axis of each."""
    x = np.asarray(x, dtype=float)[..., :, None]
    y = np.asarray(y, dtype=float)[..., None, :]
    return ((x > y) + 0.5 * (x == y)).mean(axis=(-2, -1))


def bootstrap_interval(samples: Sequence[Sequence[float]], statistic: Callable[..., np.ndarray],
                       reps: int, rng: np.random.Generator) -> tuple[float, float]:
    """The 95% percentile interval of ``statistic(*samples)`` over ``reps`` resamples, each
    sample (a variant's seeds) resampled with replacement on its own (rliable's stratified
    bootstrap, one stratum per sample). ``statistic`` reduces the last axis, so the resamples
    go through it at once, shaped (reps, seeds)."""
    arrays = [np.asarray(s, dtype=float) for s in samples]
    stats = statistic(*(a[rng.integers(0, len(a), (reps, len(a)))] for a in arrays))
    low, high = np.percentile(stats, [100 * (1 - CONFIDENCE) / 2, 100 * (1 + CONFIDENCE) / 2])
    return float(low), float(high)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """An aggregate over seeds: its value, 95% interval and how many seeds it is over."""
    value: float
    low: float
    high: float
    n: int


def estimate(values: Sequence[float], statistic: Callable[..., float], reps: int,
             rng: np.random.Generator) -> Estimate | None:
    if not len(values):
        return None
    return Estimate(float(statistic(values)), *bootstrap_interval([values], statistic, reps, rng),
                    len(values))


# ------------------------------------------------------------------------------- run scores
def run_scores(rows: list[dict], references: dict[str, float], cfg, report) -> dict:
    """One run's scores (module docstring): ``end``, ``step_<s>``, ``auc``, ``reach_<line>``
    (with ``reached_<line>``), ``collapsed`` (1/0, None when undefined) and
    ``collapse_step``."""
    steps, values = series(rows, report.metric)
    out: dict = {"end": values[-1] if values else None, "last_step": steps[-1] if steps else 0}
    at = dict(zip(steps, values))
    out.update({f"step_{s}": at.get(s) for s in report.at_steps})
    out["auc"] = (float(np.trapezoid(values, steps)) / (steps[-1] - steps[0])
                  if len(steps) >= 2 else None)
    for line, share in report.lines.items():
        target = references.get(line)
        if target is None or not steps:
            out[f"reach_{line}"] = out[f"reached_{line}"] = None
            continue
        first = next((s for s, v in zip(steps, values) if v >= share * target), None)
        out[f"reached_{line}"] = first is not None
        out[f"reach_{line}"] = first if first is not None else cfg.trainer.total_steps
    if collapse.defined_for(cfg.filter.metric):
        step = collapse.collapse_step(rows, cfg.env.env_groups, report.metric)
        out["collapsed"], out["collapse_step"] = float(step is not None), step
    else:
        out["collapsed"] = out["collapse_step"] = None
    return out


@dataclasses.dataclass
class VariantRuns:
    """A variant's finished runs: (seed, rows, references, scores)."""
    name: str
    seeds: int
    runs: list[tuple[int, list[dict], dict[str, float], dict]]

    @property
    def complete(self) -> int:
        return len(self.runs)


def collect(sweep, runs) -> list[VariantRuns]:
    """Each variant's finished runs (metrics up to trainer.total_steps), in the sweep's order:
    a run not started, failed, stopped or under way is left out until it finishes (its "end"
    would be another step's)."""
    out: dict[str, VariantRuns] = {}
    for run in runs:
        entry = out.setdefault(run.variant, VariantRuns(run.variant, 0, []))
        entry.seeds += 1
        if not reached_end(run):
            continue
        rows, refs = load_metrics(run.run_dir), load_references(run.run_dir)
        scores = run_scores(rows, refs, run.config, sweep.report)
        entry.runs.append((run.seed, rows, refs, scores))
    return list(out.values())


# ------------------------------------------------------------------------------- the report
def _cell(e: Estimate | None, seeds: int, digits: int = 3, note: str = "") -> str:
    if e is None:
        return "-"
    fmt = f"{{:.{digits}f}}"
    text = f"{fmt.format(e.value)} [{fmt.format(e.low)}, {fmt.format(e.high)}]"
    if e.n < seeds:
        note = f"n={e.n}" + (f", {note}" if note else "")
    return f"{text} ({note})" if note else text


def _values(v: VariantRuns, key: str) -> list[float]:
    return [float(s[key]) for _, _, _, s in v.runs if s.get(key) is not None]


def report_tables(sweep, variants: list[VariantRuns]) -> str:
    """The markdown report: one row per variant, one table of the named pairs."""
    r = sweep.report
    rng = np.random.default_rng(r.seed)
    header = ["variant", "runs done", f"end {r.metric}", *(f"step {s}" for s in r.at_steps),
              "AUC / steps", *(f"steps to {share:g} x {line}" for line, share in r.lines.items()),
              "collapsed (mean)", "collapse step (median)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for v in variants:
        cells = [v.name, f"{v.complete}/{v.seeds}"]
        for key in ["end", *(f"step_{s}" for s in r.at_steps), "auc"]:
            cells.append(_cell(estimate(_values(v, key), iqm, r.reps, rng), v.seeds))
        for line in r.lines:
            reached = _values(v, f"reached_{line}")
            cells.append(_cell(estimate(_values(v, f"reach_{line}"), iqm, r.reps, rng), v.seeds,
                               1, f"{int(sum(reached))}/{len(reached)} reached")
                         if reached else "- (no reference)")
        collapsed = _values(v, "collapsed")
        cells.append(_cell(estimate(collapsed, mean, r.reps, rng), v.seeds, 2)
                     if collapsed or not v.runs else "- (filter.metric: no zero-std count)")
        steps = _values(v, "collapse_step")
        cells.append(f"{np.median(steps):g} (of {len(steps)})" if steps else "-")
        lines.append("| " + " | ".join(cells) + " |")
    text = [f"# Sweep {sweep.dir}", "",
            f"IQM across seeds [95% stratified bootstrap interval, {r.reps} resamples, seed "
            f"{r.seed}] (Agarwal et al. 2021); the collapsed share is a mean, the collapse "
            f"step a median over the seeds that collapsed (docs/sweeps.md).", "", *lines]
    if r.pairs:
        by_name = {v.name: v for v in variants}
        text += ["", f"Probability of improvement, end {r.metric} (P(X > Y) [95% interval]):",
                 "", "| X | Y | P(X > Y) |", "|---|---|---|"]
        for x, y in r.pairs:
            a, b = _values(by_name[x], "end"), _values(by_name[y], "end")
            if a and b:
                p = float(probability_of_improvement(a, b))
                low, high = bootstrap_interval([a, b], probability_of_improvement, r.reps, rng)
                cell = f"{p:.3f} [{low:.3f}, {high:.3f}]"
            else:
                cell = "- (no finished evaluations)"
            text.append(f"| {x} | {y} | {cell} |")
    return "\n".join(text) + "\n"


def curves(variants: list[VariantRuns], metric: str, reps: int, seed: int
           ) -> dict[str, tuple[list[int], list[Estimate]]]:
    """Each variant's IQM curve with its intervals, over the evaluation steps all its runs
    with metrics share."""
    rng = np.random.default_rng(seed)
    out = {}
    for v in variants:
        per_run = [dict(zip(*series(rows, metric))) for _, rows, _, _ in v.runs]
        if not per_run:
            continue
        steps = sorted(set.intersection(*(set(c) for c in per_run)))
        out[v.name] = (steps, [estimate([c[s] for c in per_run], iqm, reps, rng)
                               for s in steps])
    return out


def plot_report(variants: list[VariantRuns], metric: str, reps: int, seed: int, out: Path):
    """``report.png``: each variant's IQM curve with its interval band, and the reference
    lines (drawn as ``ragen-mega plot`` draws them); returns the Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, (steps, ests)) in enumerate(curves(variants, metric, reps, seed).items()):
        color = colors[i % len(colors)]
        ax.plot(steps, [e.value for e in ests], color=color, marker=".",
                label=f"{name} (IQM, {ests[0].n if ests else 0} seeds)")
        ax.fill_between(steps, [e.low for e in ests], [e.high for e in ests], color=color,
                        alpha=0.2, linewidth=0)
    references = [(v.name, refs) for v in variants for _, _, refs, _ in v.runs[:1]]
    draw_references(ax, references, colors)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{metric} (IQM across seeds, 95% interval)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return fig


def report_main(sweep, runs) -> int:
    """Write and print the report of a loaded sweep (``ragen_mega.sweep.load_sweep``)."""
    variants = collect(sweep, runs)
    if not any(v.runs for v in variants):
        print(f"ragen-mega sweep --report: no run of {sweep.dir} has metrics yet",
              file=sys.stderr)
        return 2
    sweep_dir = Path(sweep.dir)
    text = report_tables(sweep, variants)
    (sweep_dir / REPORT_FILE).write_text(text)
    plot_report(variants, sweep.report.metric, sweep.report.reps, sweep.report.seed,
                sweep_dir / PLOT_FILE)
    print(text)
    print(f"written: {sweep_dir / REPORT_FILE}, {sweep_dir / PLOT_FILE}")
    return 0
