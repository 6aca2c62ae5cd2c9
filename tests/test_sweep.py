"""``ragen-mega sweep``: the sweep file, the estimators and the report against hand
computations on hand-written metrics, the collapse definition on hand-made sequences, and (slow)
a CI-sized sweep of real runs, locally (stopped mid-sweep and resumed, a failing run recorded)
and as a Slurm job array under the simulated slurm (tests/slurm_sim), signalled and requeued."""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from ragen_mega import collapse
from ragen_mega.config_tree import ConfigError
from ragen_mega.sweep import load_sweep, main, write_sbatch
from ragen_mega.sweep_report import (bootstrap_interval, collect, iqm, plot_report,
                                     probability_of_improvement)

REPO = Path(__file__).resolve().parents[1]
SIM = Path(__file__).resolve().parent / "slurm_sim"
BANDIT = REPO / "examples" / "bandit_cpu_demo.yaml"


def _write_sweep(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------ estimators
def test_iqm_and_bootstrap_interval_by_hand():
    # IQM: the mean of the middle half; 25% of n = 1 (n = 5, 7) or 0 (n < 4) cut from each end
    assert iqm([0.9, 0.0, 0.5, 0.3, 0.7]) == pytest.approx((0.3 + 0.5 + 0.7) / 3)
    assert iqm([10.0, 0.0, 2.0, 1.0]) == pytest.approx((1 + 2) / 2)
    assert iqm([0.2, 0.6, 0.4]) == pytest.approx(0.4)
    rng = np.random.default_rng(0)
    # 2 or 3 seeds: every resample drawing the lowest (highest) seed only, a chance of 1/4
    # (1/27) > 2.5%, makes the interval's ends the lowest and the highest seed exactly
    assert bootstrap_interval([[0.2, 0.6]], iqm, 4000, rng) == pytest.approx((0.2, 0.6))
    assert bootstrap_interval([[0.5, 0.1, 0.3]], iqm, 4000, rng) == pytest.approx((0.1, 0.5))
    # 5 seeds: the exact bootstrap distribution, all 5^5 equally likely resamples enumerated
    seeds = np.array([0.1, 0.35, 0.4, 0.8, 0.95])
    exact = sorted(np.mean(sorted(seeds[list(idx)])[1:4])
                   for idx in itertools.product(range(5), repeat=5))
    low, high = exact[int(0.025 * len(exact))], exact[int(0.975 * len(exact))]
    got = bootstrap_interval([seeds], iqm, 50_000, rng)
    assert got == pytest.approx((low, high), abs=0.015), (got, (low, high))


def test_probability_of_improvement_by_hand():
    # pairs (x, y): (.5, .4) 1, (.5, .7) 0, (.7, .4) 1, (.7, .7) a tie: 1/2 -> 2.5 / 4
    assert probability_of_improvement([0.5, 0.7], [0.4, 0.7]) == pytest.approx(0.625)
    assert probability_of_improvement([0.4, 0.7], [0.5, 0.7]) == pytest.approx(0.375)
    assert probability_of_improvement([1.0, 1.0], [0.0, 0.5]) == 1.0
    # its interval resamples each variant's seeds on its own (stratified): x drawn (.5, .5) and
    # y (.7, .7) gives 0, x (.7, .7) and y (.4, .4) gives 1, each with chance 1/16 > 2.5%; one
    # draw shared by both (x's seed i with y's seed i) would give only 1, .625 and .5
    interval = bootstrap_interval([[0.5, 0.7], [0.4, 0.7]], probability_of_improvement, 4000,
                                  np.random.default_rng(0))
    assert interval == (0.0, 1.0)


# ---------------------------------------------------------------------------------- collapse
def _rows(shares, groups, val=None):
    """metrics rows of steps 1.. with ``filter/zero_groups`` = share x groups; ``val``:
    {step: held-out success} (step 0: before training)."""
    val = val or {}
    rows = [{"step": 0, "val/success": val[0]}] if 0 in val else []
    for step, share in enumerate(shares, 1):
        row = {"step": step, "filter/zero_groups": share * groups}
        if step in val:
            row["val/success"] = val[step]
        rows.append(row)
    return rows


def test_collapse_definition_on_hand_made_runs():
    groups, peak = 10, {0: 0.1, 2: 0.6, 5: 0.45}  # held-out 0.6 at step 2, 0.45 (-0.15) at 5
    # 10 steps in a row with >= 90% zero-std groups, after the drop: collapsed at the 10th
    assert collapse.collapse_step(_rows([0.0] * 3 + [0.9] * 10, groups, peak), groups) == 13
    # 9 in a row is not
    assert collapse.collapse_step(_rows([0.0] * 3 + [0.9] * 9 + [0.8], groups, peak),
                                  groups) is None
    # 10 in a row but one step below the share in between: counting starts again
    assert collapse.collapse_step(_rows([1.0] * 5 + [0.8] + [1.0] * 9, groups, peak),
                                  groups) is None
    assert collapse.collapse_step(_rows([1.0] * 5 + [0.8] + [1.0] * 10, groups, peak),
                                  groups) == 16
    # a gap in the logged steps breaks the row
    rows = _rows([1.0] * 12, groups, peak)
    del rows[7]  # step 6 (rows start at step 0)
    assert collapse.collapse_step(rows, groups) is None
    # all groups alike but held-out success at its peak (a solved game): no collapse
    assert collapse.collapse_step(_rows([1.0] * 12, groups, {0: 0.1, 5: 0.9}), groups) is None
    # a drop of 0.09 is not enough, 0.1 is; the drop may come after the 10 steps
    assert collapse.collapse_step(_rows([1.0] * 12, groups, {2: 0.6, 5: 0.51}), groups) is None
    assert collapse.collapse_step(_rows([1.0] * 14, groups, {2: 0.6, 5: 0.6, 12: 0.5}),
                                  groups) == 12
    # no evaluation at all: never
    assert collapse.collapse_step(_rows([1.0] * 12, groups), groups) is None


# ------------------------------------------------------------------------------- sweep file
def test_sweep_file_errors_name_the_key(tmp_path):
    good = f"base: {BANDIT}\ndir: {tmp_path}/s\nvariants:\n  - {{name: a}}\n"
    sweep, runs = load_sweep(_write_sweep(tmp_path, good))
    assert [r.key for r in runs] == ["a/seed_0"]
    cases = {
        good + "seedz: [1]\n": "unknown config key 'seedz'",
        good.replace("{name: a}", "{name: a, overrides: {filter.ratoi: 0.5}}"):
            "variant 'a' seed 0: unknown config key 'filter.ratoi'",
        good.replace("{name: a}", "{name: a, overrides: {filter: {ratio: 2}}}"):
            r"variant 'a' seed 0: filter.ratio: must be in \(0, 1\]",
        good.replace("{name: a}", "{name: a, overrides: {trainer.seed: 3}}"):
            r"variants\[0\].overrides: trainer.seed set by the sweep",
        good + "report: {pairs: [[a, b]]}\n": r"report.pairs\[0\]: no variant 'b'",
        good.replace("{name: a}", "{name: a/b}"): r"variants\[0\].name: 'a/b' is not",
        good + "seeds: [1, 1]\n": "seeds: one or more distinct seeds",
        good.replace(str(BANDIT), "nowhere.yaml"): "base: .*nowhere.yaml' is not a file",
        good + "grid: {actor.lr: 0.1}\n": r"grid.actor.lr: a list",
        good + "grid: {env.name: [my/env.py]}\n": r"grid: its variant 'a_name=my/env.py' is not",
    }
    for text, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_sweep(_write_sweep(tmp_path, text))


def test_variants_grid_and_seeds_make_the_runs(tmp_path):
    path = _write_sweep(tmp_path, f"""
base: {BANDIT}
dir: {tmp_path}/s
overrides: {{trainer.total_steps: 7}}
variants:
  - {{name: a, overrides: {{filter: {{ratio: 0.5}}}}}}
  - {{name: b}}
grid: {{actor.lr: [0.001, 0.0001]}}
seeds: [3, 4]
seed_keys: {{trainer.seed: 1, env.seed: 1000}}
""")
    sweep, runs = load_sweep(path, ["actor.micro_batch_size=4"])
    assert [r.key for r in runs] == [f"{v}/seed_{s}" for s in (3, 4) for v in
                                     ("a_lr=0.001", "a_lr=0.0001", "b_lr=0.001", "b_lr=0.0001")]
    by_key = {r.key: r.config for r in runs}
    cfg = by_key["a_lr=0.0001/seed_4"]
    assert (cfg.filter.ratio, cfg.actor.lr, cfg.trainer.seed, cfg.env.seed) == (0.5, 1e-4, 4, 4000)
    assert (cfg.trainer.total_steps, cfg.actor.micro_batch_size) == (7, 4)
    assert Path(cfg.trainer.run_dir) == (tmp_path / "s" / "a_lr=0.0001" / "seed_4").resolve()
    assert by_key["b_lr=0.001/seed_3"].filter.ratio == 0.25  # the base's
    with pytest.raises(ConfigError, match="trainer.run_dir: set by the sweep"):
        load_sweep(path, ["trainer.run_dir=x"])


def test_example_sweep_is_the_issue_s_study():
    """examples/sweeps/frozen_lake_starpo.yaml: 5 variants x 5 seeds, each as RAGEN (StarPO,
    StarPO-S) and RAGEN-2 define it; the warm start is swapped for the preset to load here."""
    sweep, runs = load_sweep(REPO / "examples/sweeps/frozen_lake_starpo.yaml",
                             ["model.path=textgame-small"])
    assert len(runs) == 25 and sorted({r.seed for r in runs}) == [0, 1, 2, 3, 4]
    cfg = {r.variant: r.config for r in runs if r.seed == 0}
    assert set(cfg) == {"starpo", "starpo_s_top50", "starpo_s_top25", "starpo_s_gigpo",
                        "ragen2_filter"}
    want = {  # ratio, estimator, kl, clip low/high, strategy, metric, include_zero
        "starpo": (1.0, "grpo", 0.001, 0.2, 0.2, "top_k", "reward_std", True),
        "starpo_s_top50": (0.5, "grpo", 0.0, 0.2, 0.28, "top_k", "reward_std", True),
        "starpo_s_top25": (0.25, "grpo", 0.0, 0.2, 0.28, "top_k", "reward_std", True),
        "starpo_s_gigpo": (0.5, "gigpo", 0.0, 0.2, 0.28, "top_k", "reward_std", True),
        "ragen2_filter": (0.5, "grpo", 0.0, 0.2, 0.28, "top_p", "reward_variance", False)}
    for name, c in cfg.items():
        got = (c.filter.ratio, c.algo.adv_estimator, c.actor.kl_coef, c.actor.clip_ratio_low,
               c.actor.clip_ratio_high, c.filter.strategy, c.filter.metric, c.filter.include_zero)
        assert got == want[name], name
        assert (c.trainer.total_steps, c.actor.lr, c.env.kwargs["is_slippery"]) == \
            (200, 1e-3, False)
    assert cfg["ragen2_filter"].filter.top_p == 0.9
    seeds = {(r.config.trainer.seed, r.config.env.seed) for r in runs if r.variant == "starpo"}
    assert seeds == {(s, 100_000 * s) for s in range(5)}


# ------------------------------------------------------------------------------- the report
def _fixture_run(run_dir: Path, val: dict[int, float], zero_groups: list[float],
                 references: dict[str, float] | None) -> None:
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "val/success": v} for s, v in sorted(val.items())]
    by_step = {r["step"]: r for r in rows}
    for step, z in enumerate(zero_groups, 1):
        by_step.setdefault(step, {"step": step})["filter/zero_groups"] = z
    lines = [json.dumps(by_step[s]) for s in sorted(by_step)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if references:
        (run_dir / "references.json").write_text(json.dumps({"references": references}))


def test_committed_runs_are_done_without_checkpoints(tmp_path, monkeypatch, capsys):
    """A study's runs kept as their metrics alone (committed, then cloned elsewhere): a run the
    status file records as done whose metrics reach its last step is skipped without its
    checkpoints; a stopped one (metrics short of it) is played; the report counts the finished
    runs only."""
    import ragen_mega.sweep as sweep_module

    sweep_dir = tmp_path / "s"
    path = _write_sweep(tmp_path, f"""
base: {BANDIT}
dir: {sweep_dir}
overrides: {{trainer.total_steps: 20}}
variants: [{{name: x}}]
seeds: [0, 1]
""")
    _fixture_run(sweep_dir / "x/seed_0", {0: 0.1, 10: 0.4, 20: 0.5}, [0] * 20, None)
    _fixture_run(sweep_dir / "x/seed_1", {0: 0.1, 10: 0.3}, [0] * 12, None)
    sweep, runs = load_sweep(path)
    (sweep_dir / "sweep_status.json").write_text(json.dumps({"runs": {
        "x/seed_0": {"state": "done"}, "x/seed_1": {"state": "stopped"}}}))
    trained = []
    monkeypatch.setattr(sweep_module, "_train",
                        lambda run, *rest: trained.append(run.key) or (0, [], 0.0))
    assert sweep_module.run_locally(sweep, runs) == 0
    out = capsys.readouterr().out
    assert "[1/2] x/seed_0: done (its metrics.jsonl reaches step 20; its checkpoints are not " \
           "here), skipped" in out, out
    assert trained == ["x/seed_1"]
    [variant] = collect(sweep, runs)
    assert (variant.complete, variant.seeds, [r[0] for r in variant.runs]) == (1, 2, [0])


def _cells(report: str, variant: str) -> list[str]:
    row = next(line for line in report.splitlines() if line.startswith(f"| {variant} |"))
    return [c.strip() for c in row.strip("|").split("|")]


def _interval(cell: str) -> tuple[float, float, float]:
    m = re.match(r"([-\d.]+) \[([-\d.]+), ([-\d.]+)\]", cell)
    return float(m[1]), float(m[2]), float(m[3])


def test_report_equals_hand_computation_on_fixture_runs(tmp_path, capsys):
    """Two variants x two seeds of hand-written metrics (eval at 0, 10, 20, total 20 steps,
    env.env_groups 4): every cell against the numbers worked out by hand."""
    sweep_dir = tmp_path / "s"
    path = _write_sweep(tmp_path, f"""
base: {BANDIT}
dir: {sweep_dir}
overrides: {{trainer.total_steps: 20, env.env_groups: 4}}
variants: [{{name: x}}, {{name: y}}]
seeds: [0, 1]
report: {{at_steps: [10], lines: {{best_fixed: 1.0, optimal: 0.5}}, pairs: [[x, y]],
          reps: 4000}}
""")
    refs = {"best_fixed": 0.5, "optimal": 1.0}
    # x/seed_0 collapses: 4 of 4 groups alike from step 11 on, held-out 0.8 -> 0.6 at step 20
    _fixture_run(sweep_dir / "x/seed_0", {0: 0.0, 10: 0.8, 20: 0.6}, [0] * 10 + [4] * 10, refs)
    _fixture_run(sweep_dir / "x/seed_1", {0: 0.2, 10: 0.4, 20: 0.8}, [1] * 20, refs)
    # y/seed_0: 9 steps alike only (3.6 of 4 = 0.9), a drop of 0.5: no collapse
    _fixture_run(sweep_dir / "y/seed_0", {0: 0.0, 10: 0.5, 20: 0.0},
                 [0] * 11 + [3.6] * 9, refs)
    _fixture_run(sweep_dir / "y/seed_1", {0: 0.1, 10: 0.3, 20: 0.3}, [0] * 20, refs)
    assert main([str(path), "--report"]) == 0
    report = (sweep_dir / "report.md").read_text()
    assert report in capsys.readouterr().out
    assert (sweep_dir / "report.png").stat().st_size > 0
    # by hand. end: x 0.6, 0.8; y 0.0, 0.3. step 10: x 0.8, 0.4; y 0.5, 0.3.
    # AUC / 20 steps (trapezoids of 10 steps): x0 (0.4 + 0.7) * 10 / 20 = 0.55,
    # x1 (0.3 + 0.6) / 2 = 0.45; y0 (0.25 + 0.25) / 2 = 0.25, y1 (0.2 + 0.3) / 2 = 0.25.
    # steps to best_fixed (0.5): x0 10, x1 20, y0 10, y1 never -> 20 (the budget).
    # steps to 0.5 x optimal (0.5): the same.
    # collapsed: x0 at step 20 (steps 11-20 all alike; peak 0.8, now 0.6); x1 (1 of 4 alike)
    # no; y0: 9 steps only; y1 no.
    # With 2 seeds the IQM is the mean and the interval is [lower seed, higher seed].
    hand = {"x": [(0.7, 0.6, 0.8), (0.6, 0.4, 0.8), (0.5, 0.45, 0.55), (15, 10, 20),
                  (15, 10, 20), (0.5, 0.0, 1.0)],
            "y": [(0.15, 0.0, 0.3), (0.4, 0.3, 0.5), (0.25, 0.25, 0.25), (15, 10, 20),
                  (15, 10, 20), (0.0, 0.0, 0.0)]}
    for variant, numbers in hand.items():
        cells = _cells(report, variant)
        assert cells[1] == "2/2"  # both runs at trainer.total_steps
        for cell, want in zip(cells[2:8], numbers):
            assert _interval(cell) == pytest.approx(want), (variant, cell)
    assert "2/2 reached" in _cells(report, "x")[5] and "1/2 reached" in _cells(report, "y")[5]
    assert _cells(report, "x")[8].startswith("20 (of 1)") and _cells(report, "y")[8] == "-"
    # P(x > y) at the end: (.6>0) (.6>.3) (.8>0) (.8>.3) = 1; the interval's resamples too
    pair = next(line for line in report.splitlines() if line.startswith("| x | y |"))
    assert _interval(pair.split("|")[3].strip()) == (1.0, 1.0, 1.0)
    # the picture: each variant's IQM (here the mean of 2 seeds) at each evaluation step, and
    # the reference lines
    sweep, runs = load_sweep(path)
    fig = plot_report(collect(sweep, runs), "val/success", 100, 0, tmp_path / "p.png")
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    assert list(lines["x (IQM, 2 seeds)"].get_xdata()) == [0, 10, 20]
    assert lines["x (IQM, 2 seeds)"].get_ydata() == pytest.approx([0.1, 0.6, 0.7])
    assert lines["y (IQM, 2 seeds)"].get_ydata() == pytest.approx([0.05, 0.4, 0.15])
    assert [lines[k].get_ydata()[0] for k in ("best_fixed", "optimal")] == [0.5, 1.0]


# ------------------------------------------------------------------------------- slurm file
def test_sbatch_array_script_runs_each_task(tmp_path):
    """Each array task execs slurm/train.sbatch with exactly its run's arguments (read back
    through bash with a stand-in train.sbatch, a run directory with a space in it), and the
    script passes shellcheck."""
    path = _write_sweep(tmp_path, f"base: {BANDIT}\ndir: '{tmp_path}/a sweep'\n"  # a space
                        "variants: [{name: a}, {name: b, overrides: {actor.lr: 1.0e-4}}]\n"
                        "seeds: [0, 1]\n")
    sweep, runs = load_sweep(path)
    script = write_sbatch(sweep, runs, path)
    text = script.read_text()
    assert "#SBATCH --array=0-3" in text and "#SBATCH --requeue" in text
    assert "#SBATCH --signal=B:USR1@600" in text
    shellcheck = Path(sys.executable).parent / "shellcheck"
    check = subprocess.run([str(shellcheck), str(script)], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout
    fake = tmp_path / "repo" / "slurm"
    fake.mkdir(parents=True)
    (fake / "train.sbatch").write_text('printf "%s\\n" "$@"\n')
    for i, run in enumerate(runs):
        env = {**os.environ, "SLURM_ARRAY_TASK_ID": str(i)}
        body = text.replace(f"export RAGEN_MEGA_REPO={REPO}",
                            f"export RAGEN_MEGA_REPO={tmp_path / 'repo'}")
        out = subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == run.train_args()
    bad = subprocess.run(["bash", "-c", text], capture_output=True, text=True,
                         env={**os.environ, "SLURM_ARRAY_TASK_ID": "4"})
    assert bad.returncode == 2 and "no run for array task 4" in bad.stderr


# ------------------------------------------------------------------------ real runs (slow)
def _status(sweep_dir: Path) -> dict:
    path = sweep_dir / "sweep_status.json"
    return json.loads(path.read_text())["runs"] if path.is_file() else {}


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] \
        if path.is_file() else []


def _heavy_sweep(tmp_path: Path, tiny_run_overrides) -> tuple[Path, Path, list[str]]:
    """2 variants x 2 seeds of tiny bandit runs of 3 steps: variant `a` on the bandit; variant
    `b` on a bandit whose reset raises at seed 1's first training maps (env.seed 100000: maps
    100000, 100001), so the last run, (b, seed 1), fails; the runs go seed by seed. The report reads the
    training success (the tiny runs do not evaluate)."""
    sweep_dir = tmp_path / "sweep"
    faulty = f"{REPO / 'tests' / 'faulty_envs.py'}:FaultyBandit"
    path = _write_sweep(tmp_path, f"""
base: {BANDIT}
dir: {sweep_dir}
variants:
  - {{name: a}}
  - {{name: b, overrides: {{env.name: '{faulty}',
                            env.kwargs: {{raise_at_reset: [100000, 100001]}}}}}}
seeds: [0, 1]
report: {{metric: rollout/success, pairs: [[a, b]], reps: 1000}}
""")
    overrides = [o for o in tiny_run_overrides(tmp_path / "unused", 3, single_rank=True)
                 if not o.startswith("trainer.run_dir=")]
    return path, sweep_dir, overrides


def _sweep_process(path: Path, overrides: list[str], log: Path, *extra: str):
    return subprocess.Popen([sys.executable, "-m", "ragen_mega.cli", "sweep", str(path),
                             *overrides, *extra], cwd=REPO, stdout=open(log, "a"),
                            stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
def test_sweep_stopped_resumed_and_a_failed_run_recorded(tmp_path, tiny_run_overrides):
    path, sweep_dir, overrides = _heavy_sweep(tmp_path, tiny_run_overrides)
    log = tmp_path / "sweep.out"
    proc = _sweep_process(path, overrides, log)
    try:
        # ---- start 1: runs 1 and 2 finish; run 3 is stopped (SIGTERM to the sweep) after a step
        deadline = time.monotonic() + 600
        while not _steps(sweep_dir / "a/seed_1"):
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=300) == 75, log.read_text()[-4000:]
        status = _status(sweep_dir)
        assert [status[k]["state"] for k in ("a/seed_0", "b/seed_0", "a/seed_1")] == \
            ["done", "done", "stopped"], status
        assert status["a/seed_1"]["exit_code"] == 75 and "b/seed_1" not in status
        stopped_at = _steps(sweep_dir / "a/seed_1")[-1]
        assert 1 <= stopped_at < 3

        # ---- start 2: runs 1, 2 skipped, run 3 resumed, (b, 1) fails and is recorded
        proc = _sweep_process(path, overrides, log)
        assert proc.wait(timeout=900) == 1, log.read_text()[-4000:]
        out = log.read_text().rsplit("runs (2 variants x 2 seeds)", 1)[1]
        assert re.search(r"\[1/4\] a/seed_0: complete at step 3, skipped", out), out
        assert re.search(r"\[2/4\] b/seed_0: complete at step 3, skipped", out), out
        assert re.search(rf"\[3/4\] a/seed_1: resuming \S+ from step {stopped_at} of 3", out)
        status = _status(sweep_dir)
        for key in ("a/seed_0", "b/seed_0", "a/seed_1"):
            assert status[key]["state"] == "done", (key, status[key])
            assert sorted(set(_steps(sweep_dir / key))) == [1, 2, 3]
        failed = status["b/seed_1"]
        assert failed["state"] == "failed" and failed["exit_code"] not in (0, 75)
        assert any(re.search(r"faulty_bandit: broken reset at seed 10000[01]\b", line)
                   for line in failed["stderr_tail"]), failed
        assert "3 of 4 runs done; failed: b/seed_1" in out

        # ---- the report: variant a's end value is the mean of its two runs' last step
        assert main([str(path), *overrides, "--report"]) == 0
        ends = [json.loads((sweep_dir / f"a/seed_{s}/metrics.jsonl").read_text()
                           .splitlines()[-1])["rollout/success"] for s in (0, 1)]
        cells = _cells((sweep_dir / "report.md").read_text(), "a")
        assert _interval(cells[2]) == pytest.approx((np.mean(ends), min(ends), max(ends)),
                                                    abs=5e-4)
        assert cells[1] == "2/2" and _cells((sweep_dir / "report.md").read_text(),
                                            "b")[1] == "1/2"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for entry in _status(sweep_dir).values():  # a run left going (in a session of its own)
            if entry.get("state") == "running":
                try:
                    os.kill(entry["pid"], signal.SIGTERM)
                except ProcessLookupError:
                    continue


@pytest.mark.slow
def test_sbatch_array_task_through_simulated_slurm_requeues(tmp_path, tiny_run_overrides):
    """Task 0 of the sweep's job array (variant a, seed 0; 4 steps) under the simulated slurm
    on one node: signalled after its first step it saves, asks for the requeue of its own job
    id and stops; the requeued task resumes it to the end."""
    path, sweep_dir, overrides = _heavy_sweep(tmp_path, tiny_run_overrides)
    overrides = [o for o in overrides if not o.startswith("trainer.total_steps=")]
    assert main([str(path), *overrides, "trainer.total_steps=4", "--sbatch"]) == 0
    script, run_dir = sweep_dir / "sweep.sbatch", sweep_dir / "a" / "seed_0"
    sim_dir, ray_tmp = tmp_path / "sim", tempfile.mkdtemp(prefix="rm_sweep_")
    sim_dir.mkdir()
    from test_slurm import _free_port, _leftovers, _marked_pids

    marker = uuid.uuid4().hex
    env = {**os.environ, "PATH": f"{SIM}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "SLURM_SIM_DIR": str(sim_dir), "SLURM_SIM_MARKER": marker,
           "SLURM_JOB_ID": "5151", "SLURM_ARRAY_JOB_ID": "5150", "SLURM_ARRAY_TASK_ID": "0",
           "SLURM_JOB_NAME": "sweep", "SLURM_JOB_NODELIST": "simnode0",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_CPUS_ON_NODE": "4",
           "SLURM_SUBMIT_DIR": str(tmp_path), "RAY_TMP": ray_tmp,
           "RAY_PORT": str(_free_port()), "RAY_CLIENT_PORT": str(_free_port()),
           "RAY_OBJECT_STORE_BYTES": str(200 << 20), "RAY_WAIT_S": "120",
           "RAY_STOP_WAIT_S": "30"}
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "slurm.out"
    job = None
    try:
        # ---- launch 1: signalled after the first step: saves, requeues itself, exit 75
        job = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env,
                               stdout=open(log, "a"), stderr=subprocess.STDOUT,
                               start_new_session=True)
        deadline = time.monotonic() + 600
        while not _steps(run_dir):
            assert job.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        os.kill(job.pid, signal.SIGUSR1)  # slurm's --signal=B:USR1 goes to the batch shell
        assert job.wait(timeout=300) == 75, log.read_text()[-4000:]
        stopped_at = _steps(run_dir)[-1]
        assert stopped_at < 4 and (sim_dir / "requeued").read_text().split() == ["5151"]
        assert f"run directory {run_dir}" in log.read_text()
        assert _leftovers(marker) == [], "processes of the job outlived it"
        # ---- launch 2 (the requeued task): resumes and finishes
        env["SLURM_RESTART_COUNT"] = "1"
        job = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env,
                               stdout=open(log, "a"), stderr=subprocess.STDOUT,
                               start_new_session=True)
        assert job.wait(timeout=900) == 0, log.read_text()[-4000:]
        assert f"resuming {run_dir} from step {stopped_at} of 4" in log.read_text()
        assert _steps(run_dir)[-1] == 4
        assert sorted(set(_steps(run_dir))) == [1, 2, 3, 4]
        assert _leftovers(marker) == [], "processes of the job outlived it"
    finally:
        if job is not None and job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        for pid in _marked_pids(marker):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
