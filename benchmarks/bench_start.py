"""A run's start-up: seconds from ``ragen-mega train`` to the first rollout request, by stage.

Runs ``ragen-mega train CONFIG`` for one step with evaluation and checkpoints off, so the first
rollout request is step 1's, sent right after the first weight sync. Each start-up line the
command prints (``[  t s] ...``: the run directory, Ray, the engines, the trainer ranks and the
first sync) is stamped on arrival with the seconds since the command was launched (Python's
own start, the config and the start-up check included). The engine's log, stamped to the
second, adds its stages: SGLang imported (its first stamped line), SGLang's ``Engine startup
timings`` (weights loaded, KV cache allocated, the scheduler's start end to end) and its warm-up
request done (``fired up``).

    python benchmarks/bench_start.py [--config examples/frozen_lake_small_model_cpu.yaml]
        [--model textgame-small] [key=value ...]
"""
from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STAGE = re.compile(r"^\[\s*[\d.]+s\] (.*)$")
ENGINE_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] (.*)$")


def engine_stages(log: Path, launched: float) -> list[tuple[float, str]]:
    """(seconds since launch, stage) from an engine's log, whose lines carry wall-clock
    seconds: its first stamped line, SGLang's start-up timings, and its warm-up done."""
    stages = []
    for line in log.read_text(errors="replace").splitlines():
        m = ENGINE_STAMP.match(line)
        if not m:
            continue
        at = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S").timestamp() - launched
        text = m[2]
        if not stages:
            stages.append((at, "engine: SGLang imported, server starting (its first stamped line)"))
        if text.startswith("Engine startup timings"):
            stages.append((at, "engine: " + text.split(", cuda_graph")[0]))
        if "fired up and ready" in text:
            stages.append((at, "engine: warm-up request done"))
            break
    return stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="examples/frozen_lake_small_model_cpu.yaml")
    parser.add_argument("--model", default="textgame-small")
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="bench_start_") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "ragen_mega.cli", "train", args.config,
               f"model.path={args.model}", "trainer.total_steps=1", "trainer.eval_every=0",
               "trainer.save_every=0", f"trainer.run_dir={run_dir}", *extra]
        print("$", " ".join(cmd), flush=True)
        launched, start = time.time(), time.perf_counter()
        stages = []
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr:
            m = STAGE.match(line.rstrip())
            if m:
                stages.append((time.perf_counter() - start, m[1][:90]))
        if proc.wait():
            sys.exit(f"ragen-mega train failed (exit {proc.returncode})")
        stages += engine_stages(run_dir / "logs" / "engine_0.log", launched)
    print(f"| seconds from launch | stage ({args.config}, model {args.model}) |")
    print("|---|---|")
    for at, text in sorted(stages):
        print(f"| {at:.1f} | {text} |")


if __name__ == "__main__":
    main()
