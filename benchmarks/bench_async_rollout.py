"""Step time with the rollout overlapped with training (``async_mode: one_step_off``) vs one after
the other, on the CPU demo's shape (``examples/bandit_cpu_demo.yaml``: SmolLM2-135M, 64 bandit
episodes a step, StarPO-S keeps 16), or on another config (``--config``; streamed steps,
``rollout.mode=turns``, overlap their windows the same way).

``ragen-mega train`` runs one after the other, same seeds and steps: synchronous, then
overlapped (which recomputes the old log-probs and IS-corrects them, ``actor.tis_cap=2``; the
synchronous run keeps the demo's ``use_rollout_logprobs``), and with ``--modes`` also fully
asynchronous (``async_mode: fully``, the same correction; streamed windows too). Prints, per
mode, the median over steps 2.. (step 1 cannot overlap) of the step, rollout, train, wait,
sync and idle seconds, the ratios of the step medians to the first mode's, and the runs'
directories (``ragen-mega plot`` draws their curves).

    python benchmarks/bench_async_rollout.py [--steps 20] [--out runs/bench_async]
        [--modes sync,async,fully] [--config examples/bandit_cpu_demo.yaml] [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

DEMO = "examples/bandit_cpu_demo.yaml"
OFF_POLICY = ["actor.tis_cap=2.0", "algo.use_rollout_logprobs=false"]
MODES = {"sync": [], "async": ["trainer.async_mode=one_step_off", *OFF_POLICY],
         "fully": ["trainer.async_mode=fully", *OFF_POLICY]}
PHASES = ("time/step_s", "time/rollout_s", "time/train_s", "time/rollout_wait_s", "time/sync_s",
          "time/trainer_idle_s", "time/engine_idle_s")


def run(config: str, mode: str, steps: int, out: Path, extra: list[str]) -> list[dict]:
    """One training run of ``config`` in ``mode``; its per-step metrics."""
    run_dir = out / mode
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: pick another --out (runs are never overwritten)")
    cmd = [sys.executable, "-m", "ragen_mega.cli", "train", config, f"trainer.total_steps={steps}",
           f"trainer.run_dir={run_dir}", "trainer.save_every=0", *MODES[mode], *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def medians(history: list[dict]) -> dict[str, float]:
    later = history[1:]
    return {k: statistics.median(h[k] for h in later) for k in PHASES if all(k in h for h in later)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="runs/bench_async")
    parser.add_argument("--config", default=DEMO, help="the run's YAML config (default %(default)s)")
    parser.add_argument("--modes", default="sync,async",
                        help="runs, in order: sync, async (one step off), fully (default "
                             "%(default)s); ratios are to the first")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 cannot overlap; the medians start at step 2)")
    out = Path(args.out)
    print(f"# {platform.node()} {os.cpu_count()} CPUs, {args.config} {' '.join(args.overrides)}, "
          f"{args.steps} steps")
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    results = {mode: medians(run(args.config, mode, args.steps, out, args.overrides))
               for mode in modes}
    print("\n| mode | " + " | ".join(PHASES) + " |\n|---|" + "---|" * len(PHASES))
    for mode, m in results.items():
        print(f"| {mode} | " + " | ".join(f"{m[k]:.1f}" if k in m else "-" for k in PHASES) + " |")
    first = modes[0]
    for mode in modes[1:]:
        ratio = results[first]["time/step_s"] / results[mode]["time/step_s"]
        print(f"step time {first} / {mode}: {ratio:.2f}x")
    print(f"curves: ragen-mega plot {' '.join(f'{out}/{m}' for m in modes)} "
          f"--out {out}/curves.png")


if __name__ == "__main__":
    main()
