"""Step time with the rollout overlapped with training (``async_mode: one_step_off``) vs one after
the other, on the CPU demo's shape (``examples/bandit_cpu_demo.yaml``: SmolLM2-135M, 64 bandit
episodes a step, StarPO-S keeps 16), or on another config (``--config``; streamed steps,
``rollout.mode=turns``, overlap their windows the same way).

Two ``ragen-mega train`` runs one after the other, same seeds and steps: synchronous, then
overlapped (which recomputes the old log-probs and IS-corrects them, ``actor.tis_cap=2``; the
synchronous run keeps the demo's ``use_rollout_logprobs``). Prints, per mode, the median over
steps 2.. (step 1 cannot overlap) of the step, rollout, train, wait and sync seconds, the ratio
of the step medians, and the runs' directories (``ragen-mega plot`` draws their curves).

    python benchmarks/bench_async_rollout.py [--steps 20] [--out runs/bench_async]
        [--config examples/bandit_cpu_demo.yaml] [key=value ...]
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
MODES = {"sync": [],
         "async": ["trainer.async_mode=one_step_off", "actor.tis_cap=2.0",
                   "algo.use_rollout_logprobs=false"]}
PHASES = ("time/step_s", "time/rollout_s", "time/train_s", "time/rollout_wait_s", "time/sync_s")


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
    parser.add_argument("overrides", nargs="*", help="dotted overrides for both runs")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 cannot overlap; the medians start at step 2)")
    out = Path(args.out)
    print(f"# {platform.node()} {os.cpu_count()} CPUs, {args.config} {' '.join(args.overrides)}, "
          f"{args.steps} steps")
    results = {mode: medians(run(args.config, mode, args.steps, out, args.overrides))
               for mode in MODES}
    print("\n| mode | " + " | ".join(PHASES) + " |\n|---|" + "---|" * len(PHASES))
    for mode, m in results.items():
        print(f"| {mode} | " + " | ".join(f"{m[k]:.1f}" if k in m else "-" for k in PHASES) + " |")
    ratio = results["sync"]["time/step_s"] / results["async"]["time/step_s"]
    print(f"\nstep time sync / async: {ratio:.2f}x; curves: ragen-mega plot {out}/sync {out}/async "
          f"--out {out}/curves.png")


if __name__ == "__main__":
    main()
