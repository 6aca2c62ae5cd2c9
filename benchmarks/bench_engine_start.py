"""Start-up of a CPU SGLang server, with and without one of the launcher's start-up savings, in
one run. ``--compare fork``: its subprocesses forked (the ``forked_start.py`` plugin, what every
CPU server gets) against spawned (SGLang's own start method). ``--compare model-modules``: the
model registry importing only the modules that define the checkpoint's architectures
(``model_modules.py``, what every server gets) against all of SGLang's model modules.

A start-up is the wall time from ``launch_server`` to the server answering ``/health_generate``
(the launcher's own readiness check, which includes SGLang's warm-up request). The two ways
alternate, ``--rounds`` times each, on the same model, so a change in the machine's load falls on
both; the medians and their ratio are printed, one JSON line per start and a Markdown row at the
end. The spawned way is the same launcher with the plugin left out of ``CPU_PLUGINS``.

    python benchmarks/bench_engine_start.py [--model tiny|smollm2] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def start_once(model_dir: str, compare: str, saving: bool, log_dir: str) -> float:
    """Seconds from launch to healthy for one server (with the ``compare`` saving or without),
    shut down afterwards."""
    from ragen_mega.backends.sglang import server

    everything, env = server.CPU_PLUGINS, dict(os.environ)
    if compare == "fork" and not saving:
        server.CPU_PLUGINS = tuple(p for p in everything if p != "ragen_mega_forked_start")
    if compare == "model-modules" and not saving:
        env[server.DISABLED_MODELS_ENV] = ""   # set, so the launcher leaves it: none skipped
    try:
        start = time.perf_counter()
        handle = server.launch_server(model_dir, device="cpu", env=env,
                                      log_file=f"{log_dir}/{compare}-{saving}.log")
        seconds = time.perf_counter() - start
    finally:
        server.CPU_PLUGINS = everything
    handle.shutdown()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare", default="fork", choices=["fork", "model-modules"])
    ap.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from ragen_mega.models.prepare import cache_dir, make_tiny_model, prepare_smollm2

    smollm2 = prepare_smollm2()
    model_dir = str(smollm2 if args.model == "smollm2" else make_tiny_model(
        cache_dir() / "tiny" / "tiny-qwen2-untied", "qwen2", tie_word_embeddings=False,
        tokenizer_dir=smollm2))
    names = {"fork": ("spawned", "forked"), "model-modules": ("all modules", "needed only")}
    seconds: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="bench_engine_start_") as log_dir:
        for round_ in range(args.rounds):
            for saving in (False, True):
                s = start_once(model_dir, args.compare, saving, log_dir)
                seconds[saving].append(s)
                print(json.dumps({"model": args.model, "way": names[args.compare][saving],
                                  "round": round_, "start_s": round(s, 2)}), flush=True)
    without, with_ = (statistics.median(seconds[w]) for w in (False, True))
    print(f"| {Path(model_dir).name} start-up, median of {args.rounds} | "
          f"{names[args.compare][0]} {without:.1f} s | {names[args.compare][1]} {with_:.1f} s | "
          f"{with_ / without:.2f}x |")


if __name__ == "__main__":
    main()
