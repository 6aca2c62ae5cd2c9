"""``ragen-mega sweep SWEEP.yaml``: one run config under named variants and seeds, each
(variant, seed) its own run, and the aggregates across seeds (``--report``).

A sweep file (docs/sweeps.md, examples/sweeps/) names a base run config, overrides every run
shares, the variants (named override sets, a grid of values, or both: the grid is crossed with
each listed variant), the seeds, the keys a seed sets, and the sweep's directory. Run (variant
V, seed S) is ``SWEEP_DIR/V/seed_S`` (its ``trainer.run_dir``): the base config, the shared
overrides, V's, then each seed key set to ``S x its stride``. Runs go seed-major (every
variant's seed 0, then seed 1, ...), so a study stopped part-way compares its variants on the
same seeds. Every run's config is validated before any run starts, so a typo in a variant fails
at once, naming the variant, seed and key.

Locally the runs go one after another, each a ``ragen-mega train`` subprocess (one run's crash
or memory cannot take the sweep down). A start does what ``ragen-mega train``'s would
(:mod:`ragen_mega.run_intent`): a finished run is skipped without a subprocess, a partial one
resumed, one whose directory holds another config refused. A failed run's exit code and stderr
tail go to ``SWEEP_DIR/sweep_status.json`` while the others go on; the sweep exits 1 when any
failed. SIGTERM, SIGINT or SIGUSR1 is passed to the run under way (which saves its step and
stops) and ends the sweep; started again, it goes on where it stopped.

``--sbatch`` writes ``SWEEP_DIR/sweep.sbatch``, a Slurm job array whose task i is run i through
``slurm/train.sbatch`` (its Ray cluster, signal handling and requeue), and prints the ``sbatch``
command. ``--report``: :mod:`ragen_mega.sweep_report`.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from ragen_mega.config import RunConfig, load_run_config
from ragen_mega.config_tree import ConfigError, bounded, load_config, setting, yaml_value
from ragen_mega.run_intent import flatten

#: where each run's ``ragen-mega train`` stderr goes, under the sweep directory
LOG_DIR = "logs"
STATUS_FILE = "sweep_status.json"
SBATCH_FILE = "sweep.sbatch"
#: the lines of a failed run's stderr kept in the status file
STDERR_TAIL_LINES = 30
#: the keys the sweep sets in every run itself
_SWEEP_KEYS = ("trainer.run_dir",)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.=+,-]*")


@dataclasses.dataclass
class Variant:
    """One named set of overrides."""
    name: str = setting("", help="the variant's name: its directory under the sweep's")
    overrides: dict[str, Any] = setting(default_factory=dict, help=(
        "run config keys and values, dotted (`filter.ratio: 0.5`) or nested"))


@dataclasses.dataclass
class SweepReportConfig:
    """What ``--report`` aggregates (:mod:`ragen_mega.sweep_report`)."""
    metric: str = setting("val/success", help=(
        "the held-out curve: a metrics.jsonl key of the evaluations (docs/metrics.md)"))
    at_steps: list[int] = setting(default_factory=list, help=(
        "steps whose held-out value is reported (each an evaluation step, besides the last)"))
    lines: dict[str, float] = setting(
        default_factory=lambda: {"best_fixed": 1.0, "optimal": 0.6}, help=(
            "steps to reach each line: a reference of the run's references.json and the share "
            "of it to reach (`optimal: 0.6`: 0.6 of the optimum)"))
    pairs: list[tuple[str, str]] = setting(default_factory=list, help=(
        "[X, Y] variant pairs: the probability that a seed of X beats a seed of Y at the end"))
    reps: int = bounded(5000, ge=100, help="bootstrap resamples of each interval")
    seed: int = setting(0, help="the bootstrap's random seed (the report is reproducible)")


@dataclasses.dataclass
class SweepConfig:
    """A sweep file (module docstring)."""
    base: str = setting("", help="the base run config (YAML), relative to the sweep file")
    dir: str = setting("", help=(
        "the sweep's directory (relative to the working directory, as trainer.run_dir): run "
        "(V, S) is DIR/V/seed_S"))
    overrides: dict[str, Any] = setting(default_factory=dict, help=(
        "run config keys every run shares, dotted or nested"))
    variants: list[Variant] = setting(default_factory=list, help="named override sets")
    grid: dict[str, list] = setting(default_factory=dict, help=(
        "key: [values]: one variant per combination (crossed with each listed variant)"))
    seeds: list[int] = setting(default_factory=lambda: [0], help="the seeds of every variant")
    seed_keys: dict[str, int] = setting(
        default_factory=lambda: {"trainer.seed": 1, "env.seed": 100_000}, help=(
            "key: stride: seed S sets each key to S x stride. trainer.seed (weights' init, "
            "sampling) and env.seed (the training maps; a stride above a run's steps x "
            "env.env_groups gives each seed maps of its own; the held-out maps, env.val_seed, "
            "stay the same)"))
    report: SweepReportConfig = setting(default_factory=SweepReportConfig, help="--report")

    def validate(self):
        for key in ("base", "dir"):
            if not getattr(self, key):
                raise ConfigError(f"{key}: required")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"seeds: one or more distinct seeds, got {self.seeds}")
        for key, values in self.grid.items():
            if not isinstance(values, list) or not values:
                raise ConfigError(f"grid.{key}: a list of one or more values, got {values!r}")
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ConfigError(f"variants: names must differ, got {names}")
        if not self.variants and not self.grid:
            raise ConfigError("variants: a sweep needs variants, a grid, or both")
        for i, name in enumerate(names):
            if not _NAME.fullmatch(name):
                raise ConfigError(f"variants[{i}].name: {name!r} is not a directory name "
                                  f"(letters, digits, _ . = + , -)")
        for name in variant_overrides(self):  # the grid's, named by its values
            if not _NAME.fullmatch(name):
                raise ConfigError(f"grid: its variant {name!r} is not a directory name "
                                  f"(letters, digits, _ . = + , -); use plainer values")
        reserved = set(_SWEEP_KEYS) | set(self.seed_keys)
        for where, values in [("overrides", self.overrides),
                              *((f"variants[{i}].overrides", v.overrides)
                                for i, v in enumerate(self.variants)), ("grid", self.grid)]:
            clash = sorted(reserved & set(flatten(values) if where != "grid" else values))
            if clash:
                raise ConfigError(f"{where}: {', '.join(clash)} set by the sweep (the run "
                                  f"directory, seed_keys) for every run")
        known = set(variant_overrides(self))
        for i, pair in enumerate(self.report.pairs):
            for name in pair:
                if name not in known:
                    raise ConfigError(f"report.pairs[{i}]: no variant {name!r}; variants: "
                                      f"{', '.join(sorted(known))}")


@dataclasses.dataclass(frozen=True)
class SweepRun:
    """One (variant, seed) run: its ``ragen-mega train`` arguments and validated config."""
    variant: str
    seed: int
    run_dir: Path
    config_path: Path
    overrides: tuple[str, ...]
    config: RunConfig

    @property
    def key(self) -> str:
        return f"{self.variant}/seed_{self.seed}"

    def train_args(self) -> list[str]:
        return [str(self.config_path), *self.overrides]


def _grid_points(grid: dict[str, list]) -> list[tuple[str, dict[str, Any]]]:
    """(name, overrides) of each combination of the grid's values, names ``key=value,...``
    with each key's last part (``ratio=0.5,adv_estimator=gigpo``)."""
    keys = list(grid)
    return [(",".join(f"{k.rsplit('.', 1)[-1]}={yaml_value(v)}" for k, v in zip(keys, combo)),
             dict(zip(keys, combo))) for combo in itertools.product(*(grid[k] for k in keys))]


def variant_overrides(sweep: SweepConfig) -> dict[str, dict[str, Any]]:
    """Each variant's name -> its dotted overrides, in the sweep's order."""
    listed = [(v.name, flatten(v.overrides)) for v in sweep.variants] or [("", {})]
    points = _grid_points(sweep.grid) or [("", {})]
    return {"_".join(n for n in (name, point) if n): {**over, **extra}
            for name, over in listed for point, extra in points}


def _override(key: str, value: Any) -> str:
    return f"{key}={yaml_value(value)}"


def load_sweep(path: str | Path, overrides: Sequence[str] = (), sweep_dir: str | None = None
               ) -> tuple[SweepConfig, list[SweepRun]]:
    """The sweep file and its runs, every run's config validated; ConfigError names the sweep
    key, or the variant, seed and run config key. ``overrides`` (the command line's) apply after
    the file's shared overrides, before the variant's; ``sweep_dir`` replaces the file's ``dir``."""
    path = Path(path)
    sweep = load_config(SweepConfig, path)
    if sweep_dir:
        sweep = dataclasses.replace(sweep, dir=sweep_dir)
    clash = sorted({o.partition("=")[0] for o in overrides} & {*_SWEEP_KEYS, *sweep.seed_keys})
    if clash:
        raise ConfigError(f"{', '.join(clash)}: set by the sweep for every run (the run "
                          f"directory, seed_keys)")
    base = path.parent / sweep.base  # an absolute base stays itself
    if not base.is_file():
        raise ConfigError(f"base: {str(base)!r} is not a file (base is read relative to the "
                          f"sweep file, {str(path)!r})")
    shared = [*(_override(k, v) for k, v in flatten(sweep.overrides).items()), *overrides]
    runs = []
    for seed in sweep.seeds:
        for name, own in variant_overrides(sweep).items():
            run_dir = Path(sweep.dir).resolve() / name / f"seed_{seed}"
            args = (*shared, *(_override(k, v) for k, v in own.items()),
                    *(_override(k, seed * stride) for k, stride in sweep.seed_keys.items()),
                    f"trainer.run_dir={run_dir}")
            try:
                cfg = load_run_config(base, list(args))
            except ConfigError as e:
                raise ConfigError(f"variant {name!r} seed {seed}: {e}") from e
            if cfg.trainer.resume not in ("auto", "force"):
                raise ConfigError(f"variant {name!r} seed {seed}: trainer.resume: a sweep "
                                  f"resumes its runs where they stopped, so auto (or force), "
                                  f"got {cfg.trainer.resume!r}")
            runs.append(SweepRun(name, seed, run_dir, base.resolve(), args, cfg))
    return sweep, runs


# ------------------------------------------------------------------------------- local runs
class _Status:
    """``SWEEP_DIR/sweep_status.json``: each run's state (``running``, ``done``, ``failed``,
    ``stopped``), exit code, stderr tail and times; rewritten whole at each change."""

    def __init__(self, sweep_dir: Path):
        self.path = sweep_dir / STATUS_FILE
        self.runs: dict[str, dict] = (json.loads(self.path.read_text())["runs"]
                                      if self.path.is_file() else {})

    def set(self, run: SweepRun, **fields) -> None:
        entry = self.runs.setdefault(run.key, {})
        entry.update(variant=run.variant, seed=run.seed, run_dir=str(run.run_dir), **fields)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"runs": self.runs}, indent=2) + "\n")
        os.replace(tmp, self.path)


def reached_end(run: SweepRun) -> bool:
    """Whether the run's ``metrics.jsonl`` holds its last step: the run finished, here or on
    another machine (a committed study keeps its runs' metrics, not their checkpoints)."""
    from ragen_mega.plot import load_metrics

    if not (run.run_dir / "metrics.jsonl").is_file():
        return False
    rows = load_metrics(run.run_dir)
    return bool(rows) and rows[-1]["step"] >= run.config.trainer.total_steps


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _tail(path: Path, start: int, lines: int) -> list[str]:
    """The last ``lines`` lines of ``path`` from byte ``start`` on (this attempt's)."""
    with open(path, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace").splitlines()[-lines:]


class _Forward:
    """While installed: SIGTERM, SIGINT and SIGUSR1 go to the run under way (``child``; SIGINT
    as SIGTERM, the signal ``ragen-mega train`` saves its step on) and mark the sweep stopped
    (it starts no further run)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self):
        self.child: subprocess.Popen | None = None
        self.stopped_by: str | None = None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        self.stopped_by = signal.Signals(signum).name
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)


def run_locally(sweep: SweepConfig, runs: list[SweepRun]) -> int:
    """Run each run not yet complete, one after another (module docstring); 0 when all are
    done, 1 when any failed, 75 when a signal stopped the sweep."""
    from ragen_mega import run_intent

    sweep_dir = Path(sweep.dir)
    status = _Status(sweep_dir)
    (sweep_dir / LOG_DIR).mkdir(parents=True, exist_ok=True)
    failed = []
    with _Forward() as forward:
        for i, run in enumerate(runs, 1):
            if forward.stopped_by:
                break
            head = f"ragen-mega sweep: [{i}/{len(runs)}] {run.key}"
            try:
                plan = run_intent.start_plan(run.config)
            except run_intent.ConfigChanged as e:
                print(f"{head}: FAILED: {e}", file=sys.stderr, flush=True)
                status.set(run, state="failed", exit_code=2, stderr_tail=str(e).splitlines(),
                           ended=_now())
                failed.append(run.key)
                continue
            if plan.complete:
                print(f"{head}: complete at step {plan.resume_step}, skipped", flush=True)
                status.set(run, state="done", exit_code=0, skipped=True, ended=_now())
                continue
            if (plan.resume_step is None and status.runs.get(run.key, {}).get("state") == "done"
                    and reached_end(run)):
                print(f"{head}: done (its metrics.jsonl reaches step {plan.total_steps}; its "
                      f"checkpoints are not here), skipped", flush=True)
                continue
            print(f"{head}: {plan.message}", flush=True)
            code, tail, wall = _train(run, sweep_dir, status, forward)
            if code == 0:
                status.set(run, state="done", exit_code=0, skipped=False, stderr_tail=[],
                           wall_s=wall, ended=_now())
            elif forward.stopped_by:
                status.set(run, state="stopped", exit_code=code, stderr_tail=tail, wall_s=wall,
                           ended=_now())
                print(f"{head}: stopped by {forward.stopped_by} (exit {code}); start the sweep "
                      f"again to go on", file=sys.stderr, flush=True)
            else:
                status.set(run, state="failed", exit_code=code, stderr_tail=tail, wall_s=wall,
                           ended=_now())
                failed.append(run.key)
                print(f"{head}: FAILED with exit code {code}; the last lines of its stderr "
                      f"(all: {sweep_dir / LOG_DIR}):\n  " + "\n  ".join(tail), file=sys.stderr,
                      flush=True)
    if forward.stopped_by:
        return 75
    done = sum(1 for r in runs if status.runs.get(r.key, {}).get("state") == "done")
    print(f"ragen-mega sweep: {done} of {len(runs)} runs done"
          + (f"; failed: {', '.join(failed)} ({sweep_dir / STATUS_FILE})" if failed else ""),
          flush=True)
    return 1 if failed else 0


def _train(run: SweepRun, sweep_dir: Path, status: _Status, forward: _Forward
           ) -> tuple[int, list[str], float]:
    """One ``ragen-mega train`` subprocess for ``run``: (exit code, its stderr's last lines,
    seconds). stdout goes to the console, stderr to ``SWEEP_DIR/logs/V.seed_S.stderr``."""
    log = sweep_dir / LOG_DIR / f"{run.variant}.seed_{run.seed}.stderr"
    with open(log, "ab") as err:
        err.write(f"===== {_now()} ragen-mega train {shlex.join(run.train_args())}\n".encode())
        err.flush()
        start, began = err.tell(), time.monotonic()
        # its own session: a terminal's Ctrl-C reaches the sweep only, which passes it on
        child = subprocess.Popen([sys.executable, "-m", "ragen_mega.cli", "train",
                                  *run.train_args()], stderr=err, start_new_session=True)
        forward.child = child
        status.set(run, state="running", pid=child.pid, started=_now(), log=str(log))
        code = child.wait()
        forward.child = None
    return code, _tail(log, start, STDERR_TAIL_LINES), round(time.monotonic() - began, 1)


# ------------------------------------------------------------------------------ slurm array
def _train_sbatch_directives(repo: Path) -> list[str]:
    """slurm/train.sbatch's ``#SBATCH`` lines but its job name and output file."""
    lines = (repo / "slurm" / "train.sbatch").read_text().splitlines()
    return [line for line in lines if line.startswith("#SBATCH")
            and not re.match(r"#SBATCH --(job-name|output|array)\b", line)]


def write_sbatch(sweep: SweepConfig, runs: list[SweepRun], sweep_file: Path) -> Path:
    """``SWEEP_DIR/sweep.sbatch``: a job array, task i running ``runs[i]`` with
    slurm/train.sbatch (its #SBATCH lines, Ray cluster, signal forwarding and requeue);
    its paths (config, run directories) are absolute, so the job may start anywhere."""
    repo = Path(__file__).resolve().parents[1]
    sweep_dir = Path(sweep.dir).resolve()
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", sweep_file.stem)
    cases = "\n".join(f"  {i}) run=({shlex.join(r.train_args())}) ;;" for i, r in enumerate(runs))
    text = "\n".join([
        "#!/usr/bin/env bash",
        f"# ragen-mega sweep {sweep_file} --sbatch: one array task per (variant, seed) run;",
        "# each runs slurm/train.sbatch (Ray on the task's nodes; a signal saves the step and",
        "# requeues the task, which resumes). Options given to sbatch override these lines.",
        f"#SBATCH --job-name={name}", f"#SBATCH --array=0-{len(runs) - 1}",
        f"#SBATCH --output={sweep_dir / LOG_DIR}/slurm-%A_%a.out",
        *_train_sbatch_directives(repo),
        "set -euo pipefail",
        'case "${SLURM_ARRAY_TASK_ID:?not a task of a job array}" in',
        cases,
        '  *) echo "sweep.sbatch: no run for array task $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;',
        "esac",
        f"export RAGEN_MEGA_REPO={shlex.quote(str(repo))}",
        'exec bash "$RAGEN_MEGA_REPO/slurm/train.sbatch" "${run[@]}"', ""])
    out = sweep_dir / SBATCH_FILE
    (sweep_dir / LOG_DIR).mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


def main(argv: list[str] | None = None) -> int:
    """``ragen-mega sweep SWEEP.yaml [key=value ...] [--sbatch | --report]``"""
    import argparse

    parser = argparse.ArgumentParser(prog="ragen-mega sweep", description=main.__doc__)
    parser.add_argument("sweep", help="the sweep file (YAML; docs/sweeps.md)")
    parser.add_argument("overrides", nargs="*", help=(
        "run config overrides every run shares (key=value), after the sweep file's"))
    parser.add_argument("--dir", help=(
        "the sweep's directory instead of the file's `dir` (a fresh copy of a committed study)"))
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--sbatch", action="store_true", help=(
        "write SWEEP_DIR/sweep.sbatch, one Slurm job array, and print its sbatch command"))
    action.add_argument("--report", action="store_true", help=(
        "aggregate the runs: SWEEP_DIR/report.md and report.png"))
    args = parser.parse_args(argv)
    try:
        sweep, runs = load_sweep(args.sweep, args.overrides, sweep_dir=args.dir)
    except ConfigError as e:
        print(f"ragen-mega sweep: config error: {e}", file=sys.stderr)
        return 2
    if args.report:
        from ragen_mega.sweep_report import report_main

        return report_main(sweep, runs)
    if args.sbatch:
        path = write_sbatch(sweep, runs, Path(args.sweep))
        print(f"{len(runs)} runs as one job array; submit from anywhere with:\n  sbatch {path}\n"
              f"(sbatch options override its #SBATCH lines, e.g. sbatch --nodes=1 "
              f"--gpus-per-node=1 {path})")
        return 0
    print(f"ragen-mega sweep: {len(runs)} runs ({len(variant_overrides(sweep))} variants x "
          f"{len(sweep.seeds)} seeds) in {sweep.dir}", flush=True)
    return run_locally(sweep, runs)
